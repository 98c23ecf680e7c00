"""GrammarSpec: what is refused before any compile, each with a message that says where."""
from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgument
from services.decoder.grammar.spec import PARAM, GrammarSpec


def refused(text: str) -> str:
    with pytest.raises(InvalidArgument) as exc:
        GrammarSpec.json_schema(text)
    assert exc.value.param == PARAM
    return exc.value.message


@pytest.mark.parametrize("schema, where", [
    ({"allOf": [{"type": "integer"}]}, "#/allOf"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "#/oneOf"),
    ({"type": "integer", "not": {"const": 0}}, "#/not"),
    ({"if": {"minimum": 0}, "then": {"maximum": 3}}, "#/if"),
    ({"type": "array", "uniqueItems": True}, "#"),
    ({"type": "array", "contains": {"const": 1}}, "#/contains"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "#/dependentRequired"),
    ({"type": "number", "multipleOf": 0.5}, "#"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"not": {}}}}}, "#/properties/a/items/not"),
    ({"anyOf": [{"type": "null"}, {"allOf": []}]}, "#/anyOf/1/allOf"),
    ({"$defs": {"x": {"oneOf": []}}, "$ref": "#/$defs/x"}, "#/$defs/x/oneOf"),
    ({"type": "array", "items": [{"type": "integer"}]}, "#"),
    ({"type": "object", "unevaluatedProperties": {"type": "integer"}}, "#"),
    ({"type": "object", "required": ["a"]}, "requires 'a'"),          # xgrammar would write {} for it
    ({"type": "object", "properties": {"o": {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}}},
     "#/properties/o requires 'b'"),
])
def test_unenforceable_keywords_are_refused_by_pointer(schema, where):
    assert where in refused(json.dumps(schema))


def test_enforced_keywords_and_annotations_pass():
    schema = {"title": "t", "description": "d", "type": "object", "x-vendor": 1,
              "properties": {"not": {"type": "string", "maxLength": 3},          # a property named like a keyword
                             "n": {"type": "integer", "multipleOf": 3, "minimum": 0},
                             "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": False,
                                      "maxItems": 2}},
              "required": ["not"], "additionalProperties": False, "unevaluatedProperties": False}
    spec = GrammarSpec.json_schema(json.dumps(schema, indent=2))
    # Canonical text: whitespace gone, key order kept (it is the order properties are generated in).
    assert spec.key == ("json_schema", json.dumps(schema, separators=(",", ":")))
    assert GrammarSpec.json_schema(json.dumps(schema)).key == spec.key


@pytest.mark.parametrize("text, says", [("{nope", "not valid JSON"), ("[1, 2]", "must be a JSON object"),
                                        ("true", "must be a JSON object"), ('"s"', "must be a JSON object"),
                                        ('{"properties": []}', "must be an object"),
                                        ('{"anyOf": {}}', "must be a list")])
def test_malformed_schemas_are_refused(text, says):
    assert says in refused(text)


def test_deep_schemas_are_refused_not_recursed():
    deep = '{"items":' * 100 + "{}" + "}" * 100
    assert "deeper" in refused(deep)


def test_other_kinds():
    for make, arg, says in ((GrammarSpec.choice, [], "at least one"), (GrammarSpec.choice, ["a", ""], r"choice\[1\]"),
                            (GrammarSpec.regex, "", "empty"), (GrammarSpec.grammar, "  \n", "empty")):
        with pytest.raises(InvalidArgument, match=says) as exc:
            make(arg)
        assert exc.value.param == PARAM
    assert GrammarSpec.choice(["naïve", 'q"']).text == '["naïve", "q\\""]'
    assert GrammarSpec.json_object().key == ("json_object", "")
