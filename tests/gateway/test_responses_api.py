"""OpenAI's Responses API (POST /v1/responses) end to end through the official `openai` client, on the tiny
random Qwen2 with the hermes tool template (tests/gateway/tool_model.py), served with --enable-auto-tool-choice
--tool-call-parser hermes.

The route translates into the chat path, so each answer is checked against the chat completion of the same
conversation (greedy: the same text, the same calls, the same usage); streamed against whole (the same items);
the stream's event order against the recorded sequence for text, structured and tool-call answers. Forced calls
validate against their function's parameters; a function_call_output round trip is answered; text.format
json_schema parses into the pydantic model. Refused fields are 400s naming the field, the decoder serving after.
"""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.decoder.text.tool_template import PARAMETERS, TOOLS
from tests.gateway.chat_fleet import MODEL, chat_fleet, still_up

ASK = "What is the weather in Paris, and the time in CET?"
SYSTEM = "You help with weather and time."
FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tool_chat_model):
    with chat_fleet(tool_chat_model, tmp_path_factory.mktemp("responses"),
                    ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")) as f:
        yield f


def respond(client, **kw):
    kw.setdefault("max_output_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.responses.create(model=MODEL, input=kw.pop("input", ASK), **kw)


def streamed(client, **kw) -> tuple[list[str], object]:
    """(event types in order, the final response) of a streamed answer, checking sequence numbers."""
    types, last = [], None
    for i, event in enumerate(respond(client, stream=True, **kw)):
        assert event.sequence_number == i, event
        types.append(event.type)
        last = event
    return types, last.response


def items(response) -> list[tuple]:
    """The output items without their random ids."""
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", item.status, tuple(c.text for c in item.content)))
        else:
            out.append(("function_call", item.status, item.name, item.arguments))
    return out


TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


def collapse(types: list[str]) -> list[str]:
    """Runs of the same delta event as one."""
    return [t for i, t in enumerate(types) if not (i and t == types[i - 1] and t.endswith(".delta"))]


def test_text_equals_chat_and_streams_in_order(client):
    whole = respond(client, instructions=SYSTEM)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_completion_tokens=24, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    else:
        assert whole.status == "completed" and whole.incomplete_details is None
    types, final = streamed(client, instructions=SYSTEM)
    assert collapse(types) == [*TEXT_EVENTS, f"response.{whole.status}"]
    assert items(final) == items(whole) and final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0    # the same prompt again: a prefix-cache hit


def test_max_output_tokens_cut_is_incomplete(client):
    whole = respond(client, max_output_tokens=3, extra_body={"ignore_eos": True})
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 3 and whole.output[0].status == "incomplete"


def test_forced_function_call_and_its_stream(client):
    whole = respond(client, tools=FUNCTIONS, tool_choice={"type": "function", "name": "get_time"},
                    max_output_tokens=60)
    assert [i.type for i in whole.output] == ["function_call"]
    call = whole.output[0]
    assert call.name == "get_time" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), PARAMETERS["get_time"])
    types, final = streamed(client, tools=FUNCTIONS, tool_choice={"type": "function", "name": "get_time"},
                            max_output_tokens=60)
    assert collapse(types) == ["response.created", "response.in_progress", "response.output_item.added",
                               "response.function_call_arguments.delta", "response.function_call_arguments.done",
                               "response.output_item.done", "response.completed"]
    assert types.count("response.function_call_arguments.delta") > 1     # arguments stream as written
    assert "response.output_text.delta" not in types                    # call text never leaks as text
    assert items(final) == items(whole)


def test_required_calls_and_the_output_round_trip(client):
    first = respond(client, tools=FUNCTIONS, tool_choice="required", parallel_tool_calls=False,
                    max_output_tokens=80)
    calls = [i for i in first.output if i.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), PARAMETERS[calls[0].name])
    # The client sends the earlier output back with the call's result, as the SDK's examples do.
    conversation = [{"role": "user", "content": ASK}, *first.output,
                    {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C, sunny"}]
    second = respond(client, input=conversation, tools=FUNCTIONS, tool_choice="none")
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_completion_tokens=24, tools=TOOLS,
                                          tool_choice="none", messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function",
         "function": {"name": calls[0].name, "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "18C, sunny"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_auto_tools_stream_equals_whole(client):
    whole = respond(client, tools=FUNCTIONS, max_output_tokens=40)
    _, final = streamed(client, tools=FUNCTIONS, max_output_tokens=40)
    assert items(final) == items(whole)


class Forecast(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]   # closed values: the random model's free strings would run past the budget
    sunny: bool


def test_text_format_json_schema_parses(client):
    parsed = client.responses.parse(model=MODEL, input=ASK, text_format=Forecast, temperature=0,
                                    max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Forecast), parsed.output_text
    types, final = streamed(client, max_output_tokens=60, text={"format": {
        "type": "json_schema", "name": "forecast", "schema": Forecast.model_json_schema(), "strict": True}})
    assert collapse(types) == [*TEXT_EVENTS, "response.completed"]
    assert Forecast.model_validate_json(final.output_text) == parsed.output_parsed
    obj = respond(client, text={"format": {"type": "json_object"}}, max_output_tokens=40)
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


def test_logprobs_included(client):
    whole = respond(client, include=["message.output_text.logprobs"], top_logprobs=2, max_output_tokens=6)
    logprobs = whole.output[0].content[0].logprobs
    assert len(logprobs) == whole.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in logprobs)


@pytest.mark.parametrize("extra, field", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_x"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": FUNCTIONS}, "tool_choice"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"top_k": 2**40}, "top_k"),            # looser in the Responses model than in chat's: still a 400
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "not": {}}}}}, "text"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_refusals_name_the_field(fleet, extra, field):
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 4, **extra}
    reply = fleet["http"].post("/v1/responses", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field, reply.json()
    with pytest.raises(openai.BadRequestError):
        fleet["client"].responses.create(model=MODEL, input=body.pop("input"), extra_body=body)
    still_up(fleet)


def test_the_clients_stream_helper_accumulates_the_same_answer(client):
    """responses.stream rebuilds the response from the events itself (by output and content index): it must
    arrive at the whole answer, text and forced calls alike. (It wants response.completed, so both answers are
    ones a grammar ends: the random model's free text runs to max_output_tokens.)"""
    schema = {"format": {"type": "json_schema", "name": "forecast", "schema": Forecast.model_json_schema()}}
    for kw in ({"text": schema}, {"tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "get_time"}}):
        kw = {"max_output_tokens": 60, **kw}
        whole = respond(client, **kw)
        assert whole.status == "completed", (kw, whole.output)
        with client.responses.stream(model=MODEL, input=ASK, temperature=0, **kw) as stream:
            text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            final = stream.get_final_response()
        assert items(final) == items(whole) and text == whole.output_text
