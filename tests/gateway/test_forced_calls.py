"""Forced tool calls (gateway/forced_calls.py) and the tool plan (gateway/tools.py), without servers.

The schemas: what they accept and refuse (jsonschema), that references inside a tool's parameters still
resolve once the parameters move under $defs, and that the decoder's checks and xgrammar compile them.
The readers: hand-written grammar output at every split gives the same calls, streamed arguments
concatenate to the arguments, and the plan's refusals name their field.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from gateway.forced_calls import NamedCall, RequiredCalls, object_schema, required_schema
from gateway.routes.chat import ChatRequest
from gateway.tool_calls import ChoiceToolCalls
from services.common.errors import InvalidArgument
from services.common.pb import decoder_pb2
from services.common.tool_parsers import CallArguments, CallName, HermesParser

WEATHER = {"type": "object", "properties": {"city": {"$ref": "#/$defs/city"}, "days": {"type": "integer"}},
           "required": ["city"], "$defs": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]
ASK = [{"role": "user", "content": "weather?"}]


def calls_of(parser, pieces):
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    out = {}
    for e in events:
        if isinstance(e, CallName):
            out[e.index] = [e.name, ""]
        elif isinstance(e, CallArguments):
            out[e.index][1] += e.text
    return [tuple(v) for v in out.values()]


def test_required_schema_accepts_calls_and_refuses_the_rest():
    schema = required_schema([("get_weather", WEATHER), ("ping", None)], parallel=True)
    ok = [{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, {"name": "ping", "arguments": {}}]
    jsonschema.validate(ok, schema)       # the moved $ref resolves under $defs/get_weather
    for bad in ([], [{"name": "get_weather", "arguments": {"city": "Oslo"}}], [{"name": "nope", "arguments": {}}],
                [{"name": "ping"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema([("ping", None)], parallel=False)
    assert single["maxItems"] == 1 and "anyOf" not in single["items"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ping", "arguments": {}}] * 2, single)


def test_data_keywords_are_not_rewritten():
    params = {"type": "object", "properties": {"x": {"const": {"$ref": "#/keep"}, "default": {"$ref": "#/keep"}}}}
    moved = required_schema([("f", params)], parallel=True)["$defs"]["f"]
    assert moved["properties"]["x"] == params["properties"]["x"]


def test_the_schemas_pass_the_decoders_checks_and_compile():
    from xgrammar.testing import _json_schema_to_ebnf

    from services.decoder.grammar.spec import GrammarSpec

    for schema in (required_schema([("get_weather", WEATHER), ("ping", None)], parallel=True),
                   object_schema(WEATHER), object_schema(None)):
        spec = GrammarSpec.json_schema(json.dumps(schema))
        assert "root ::=" in _json_schema_to_ebnf(spec.text, any_whitespace=False, strict_mode=True)


REQUIRED_TEXT = ('[{"name": "get_weather", "arguments": {"city": "Paris", "note": "a \\"}\\" ]"}}, '
                 '{"name": "ping", "arguments": {}}]')


def test_required_calls_at_every_split():
    want = [("get_weather", '{"city": "Paris", "note": "a \\"}\\" ]"}'), ("ping", "{}")]
    pieces = [[REQUIRED_TEXT], list(REQUIRED_TEXT)] + [[REQUIRED_TEXT[:i], REQUIRED_TEXT[i:]]
                                                       for i in range(1, len(REQUIRED_TEXT))]
    for split in pieces:
        assert calls_of(RequiredCalls(), split) == want, split


def test_required_calls_stream_arguments_as_they_come():
    parser = RequiredCalls()
    assert parser.feed('[{"name": "ping"') == [CallName(0, "ping")]
    assert parser.feed(', "arguments": {"a"') == [CallArguments(0, '{"a"')]
    assert parser.feed(": 1}}, {") == [CallArguments(0, ": 1}")]
    assert parser.feed('"name": "ping", "arguments": {') == [CallName(1, "ping"), CallArguments(1, "{")]
    assert parser.finish() == []       # cut there (max_tokens): call 1's arguments stay unfinished


def test_named_call_is_all_arguments():
    assert calls_of(NamedCall("get_weather"), ['{"city"', ': "Rome"}']) == [("get_weather", '{"city": "Rome"}')]
    assert calls_of(NamedCall("ping"), []) == [("ping", "")]


def test_choice_deltas_follow_openais_stream_shape():
    calls = ChoiceToolCalls(HermesParser())
    deltas = calls.feed('Hi.<tool_call>{"name": "ping", "arguments": {}}</tool_call>')
    assert deltas[0] == {"content": "Hi."}
    first, args = deltas[1]["tool_calls"][0], deltas[2]["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "ping", "arguments": ""}
    assert args == {"index": 0, "function": {"arguments": "{}"}}
    assert calls.calls == [{"id": first["id"], "type": "function", "function": {"name": "ping", "arguments": "{}"}}]
    assert calls.finish_reason("stop") == "tool_calls" and calls.finish_reason("length") == "length"
    assert ChoiceToolCalls(HermesParser()).whole("plain") == ("plain", [])


def body(**kw) -> ChatRequest:
    return ChatRequest.model_validate({"messages": ASK, **kw})


def plan_error(kw, parser="hermes", constraint=None) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as exc:
        body(**kw).tool_plan("m", parser, constraint)
    return exc.value


@pytest.mark.parametrize("kw, parser, constraint, param, says", [
    ({"tool_choice": "auto"}, "hermes", None, "tool_choice", "only allowed when tools"),
    ({"tool_choice": "none"}, "hermes", None, "tool_choice", "only allowed when tools"),
    ({"parallel_tool_calls": False}, "hermes", None, "parallel_tool_calls", "only allowed when tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "hermes", None,
     "tool_choice", "not in tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "hermes", None, "tools", "more than once"),
    ({"tools": TOOLS}, None, None, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "", None, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": TOOLS, "tool_choice": "required"}, "hermes", "response_format", "response_format", "second"),
    ({"tools": TOOLS}, "hermes", "structured_outputs", "structured_outputs", "rule out"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "hermes", None, "tools",
     "strict"),
])
def test_plan_refusals_name_the_field(kw, parser, constraint, param, says):
    err = plan_error(kw, parser, constraint)
    assert err.param == param and says in err.message, err.message


def test_plans():
    assert body().tool_plan("m", None, None).mode == ""
    none = body(tools=TOOLS, tool_choice="none").tool_plan("m", None, "response_format")
    assert none.mode == "none" and none.parser is None and none.schema is None
    auto = body(tools=TOOLS, parallel_tool_calls=False).tool_plan("m", "hermes", None)
    params = decoder_pb2.SamplingParams(stop=["x"])
    auto.apply(params)
    assert auto.mode == "auto" and list(params.stop) == ["x", "</tool_call>"] and not params.HasField(
        "structured_output")
    named = body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}}).tool_plan("m", None,
                                                                                                        None)
    params = decoder_pb2.SamplingParams()
    named.apply(params)
    assert json.loads(params.structured_output.json_schema) == {"type": "object", "properties": {}}
    assert isinstance(named.parser(), NamedCall)
    required = body(tools=TOOLS, tool_choice="required").tool_plan("m", None, None)
    assert required.schema["minItems"] == 1 and "maxItems" not in required.schema


@pytest.mark.parametrize("tools, says", [
    ([], "at least 1"),
    ([{"type": "custom", "custom": {"name": "f"}}], "function"),
    ([{"type": "function", "function": {}}], "name"),
    ([{"type": "function", "function": {"name": "has space"}}], "pattern"),
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], "dict"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}], "not a valid JSON Schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "type: object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"minimum": "x"}}}}}],
     "not a valid JSON Schema at properties/a/minimum"),
])
def test_bad_tool_shapes_are_refused(tools, says):
    with pytest.raises(ValidationError, match=says):
        body(tools=tools)


# Which role may carry tool_calls or tool_call_id, and that content is present, are the decoder's rules
# (tests/decoder/server/test_validation.py); the gateway refuses a message's wrong JSON shape.
@pytest.mark.parametrize("message, says", [
    ({"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f",
                                                                                       "arguments": {}}}]},
     "string"),
    ({"role": "developer", "content": "x"}, "role"),
    ({"role": "tool", "content": "x", "tool_call_id": 5}, "tool_call_id"),
])
def test_bad_tool_messages_are_refused(message, says):
    with pytest.raises(ValidationError, match=says):
        ChatRequest.model_validate({"messages": [message]})
