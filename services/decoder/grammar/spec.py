"""What a request constrains its output to, checked before anything is compiled. No xgrammar here.

    spec = GrammarSpec.json_schema('{"type": "object", ...}')   # or .regex(...), .choice([...]), ...
    spec.key   # ("json_schema", canonical text): the compile cache's key

A JSON schema is refused when it uses an assertion xgrammar 0.2.8 does not enforce: a request that
names one would otherwise get output that may not validate, silently (docs/design.md, invariant 8). Each refusal was
found by compiling the keyword and validating random grammar-following outputs with `jsonschema`
(tests/decoder/grammar/test_enforcement.py keeps the allowed ones honest). Keywords no validator
checks (title, description, unknown ones) cannot make an output invalid and pass through.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from services.common.errors import InvalidArgument

PARAM = "structured_output"
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

# Assertions xgrammar would drop (any value), and why a caller cannot have them.
REFUSED = {
    "allOf": "allOf", "oneOf": "oneOf (it is matched as anyOf)", "not": "not", "if": "if/then/else",
    "then": "if/then/else", "else": "if/then/else", "contains": "contains", "minContains": "minContains",
    "maxContains": "maxContains", "dependentRequired": "dependentRequired",
    "dependentSchemas": "dependentSchemas", "dependencies": "dependencies", "$dynamicRef": "$dynamicRef",
    "$recursiveRef": "$recursiveRef",
}
# Keywords whose subschemas are walked: one schema, a list of them, a name -> schema map.
_ONE = ("additionalProperties", "items", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_LIST = ("anyOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
MAX_DEPTH = 64


@dataclass(frozen=True)
class GrammarSpec:
    """kind is one of KINDS; text is canonical for the kind: compact schema JSON, the regex, the
    EBNF text, the choices as a JSON list, "" for json_object."""

    kind: str
    text: str

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.text

    @classmethod
    def json_schema(cls, text: str) -> GrammarSpec:
        try:
            schema = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InvalidArgument(f"the JSON schema is not valid JSON: {exc}", param=PARAM) from None
        if not isinstance(schema, dict):
            raise InvalidArgument(f"the JSON schema must be a JSON object, got {type(schema).__name__}",
                                  param=PARAM)
        check_schema(schema)
        # Key order is kept: it is the order the properties are generated in.
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        if not pattern:
            raise InvalidArgument("the regex is empty", param=PARAM)
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        if not choices:
            raise InvalidArgument("choice must list at least one string", param=PARAM)
        for i, c in enumerate(choices):
            if not c:
                raise InvalidArgument(f"choice[{i}] is empty", param=PARAM)
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def grammar(cls, text: str) -> GrammarSpec:
        if not text.strip():
            raise InvalidArgument("the grammar is empty", param=PARAM)
        return cls("grammar", text)


def check_schema(schema, where: str = "#", depth: int = 0) -> None:
    """Raise InvalidArgument naming the first keyword (by JSON pointer) xgrammar would not enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidArgument(f"the JSON schema at {where} must be an object or a boolean", param=PARAM)
    if depth > MAX_DEPTH:
        raise InvalidArgument(f"the JSON schema nests deeper than {MAX_DEPTH} levels", param=PARAM)
    for key, what in REFUSED.items():
        if key in schema:
            raise InvalidArgument(f"the JSON schema uses {what} at {where}/{key}, which structured outputs "
                                  f"cannot enforce", param=PARAM)
    if schema.get("uniqueItems") is True:
        raise InvalidArgument(f"the JSON schema uses uniqueItems at {where}, which structured outputs cannot "
                              f"enforce", param=PARAM)
    if "multipleOf" in schema and not (schema.get("type") == "integer" and isinstance(schema["multipleOf"], int)):
        raise InvalidArgument(f"the JSON schema uses multipleOf at {where}; structured outputs enforce it on "
                              f"integers only (type: integer, an integer multipleOf)", param=PARAM)
    required = schema.get("required")
    if isinstance(required, list):
        named = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        missing = [r for r in required if r not in named]
        if missing:
            # xgrammar generates only the properties a schema names, so the output would lack these.
            raise InvalidArgument(f"the JSON schema at {where} requires {missing[0]!r}, which its properties do not "
                                  f"define; structured outputs generate only named properties", param=PARAM)
    for key in ("unevaluatedProperties", "unevaluatedItems"):
        # False is what xgrammar's strict mode does anyway; a schema would be dropped.
        if key in schema and schema[key] is not False:
            raise InvalidArgument(f"the JSON schema uses {key} at {where} with a schema; only false is "
                                  f"supported", param=PARAM)
    for key in _ONE:
        value = schema.get(key)
        if isinstance(value, list) and key == "items":   # draft-4 tuple form
            raise InvalidArgument(f"the JSON schema uses the list form of items at {where}; use prefixItems",
                                  param=PARAM)
        if value is not None:
            check_schema(value, f"{where}/{key}", depth + 1)
    for key in _LIST:
        value = schema.get(key)
        if value is not None:
            if not isinstance(value, list):
                raise InvalidArgument(f"the JSON schema's {key} at {where} must be a list", param=PARAM)
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}/{key}/{i}", depth + 1)
    for key in _MAP:
        value = schema.get(key)
        if value is not None:
            if not isinstance(value, dict):
                raise InvalidArgument(f"the JSON schema's {key} at {where} must be an object", param=PARAM)
            for name, sub in value.items():
                check_schema(sub, f"{where}/{key}/{name}", depth + 1)
