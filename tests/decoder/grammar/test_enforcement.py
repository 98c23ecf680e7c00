"""The schema keywords structured outputs accept are enforced: random grammar-following token walks (a model
with no preference) always give JSON that `jsonschema` validates. This is what keeps spec.REFUSED honest: a
keyword xgrammar dropped would show up here as an invalid output."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from services.decoder.grammar.spec import GrammarSpec
from tests.decoder.grammar.conftest import walk

CASES = {
    "string bounds": {"type": "string", "minLength": 2, "maxLength": 4},
    "pattern": {"type": "string", "pattern": "^[a-c]{2}$"},
    "format date": {"type": "string", "format": "date"},
    "integer range": {"type": "integer", "minimum": 3, "maximum": 17},
    "exclusive range": {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 7},
    "number range": {"type": "number", "minimum": -1.5, "maximum": 2.25},
    "integer multipleOf": {"type": "integer", "multipleOf": 7, "minimum": -50, "maximum": 50},
    "array bounds": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                     "minItems": 2, "maxItems": 3},
    "prefixItems": {"type": "array", "prefixItems": [{"enum": ["a"]}, {"type": "boolean"}], "items": False},
    "object": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5},
                                                "b": {"enum": ["x", None, 1.5, {"k": [1]}]}},
               "required": ["a", "b"], "additionalProperties": False},
    "maxProperties": {"type": "object", "properties": {k: {"type": "boolean"} for k in "abc"}, "maxProperties": 1},
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}, {"type": "null"}]},
    "const": {"const": {"a": [1, "naïve\n\"q\""]}},
    "$defs/$ref": {"$defs": {"d": {"type": "integer", "minimum": 0, "maximum": 3}}, "type": "array",
                   "items": {"$ref": "#/$defs/d"}, "maxItems": 3},
    "nullable string": {"type": ["string", "null"], "maxLength": 3},
}


@pytest.mark.parametrize("name", list(CASES))
def test_accepted_keywords_hold_on_random_walks(compiler, tokenizer, name):
    schema = CASES[name]
    grammar = compiler.compile_now(GrammarSpec.json_schema(json.dumps(schema)))
    rng = np.random.default_rng(sum(map(ord, name)))
    finished = 0
    for _ in range(12):
        tokens = walk(grammar, rng)
        if tokens is None:
            continue
        finished += 1
        text = tokenizer.decode(tokens)
        jsonschema.validate(json.loads(text), schema)     # strict json: a raw control byte would fail here
    assert finished >= 6, f"only {finished} of 12 walks ended"


def test_a_refused_keyword_would_fail_here(compiler, tokenizer):
    """The check has teeth: uniqueItems, compiled past the refusal, lets xgrammar write [1, 1]."""
    schema = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
    grammar = compiler.compile_now(GrammarSpec("json_schema", json.dumps(schema)))
    rng = np.random.default_rng(0)
    outputs = [json.loads(tokenizer.decode(walk(grammar, rng))) for _ in range(16)]
    assert any(not jsonschema.Draft202012Validator(schema).is_valid(o) for o in outputs)
