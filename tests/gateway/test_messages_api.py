"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) end to end through the official
`anthropic` client, on the tiny random Qwen2 with the hermes tool template (tests/gateway/tool_model.py).

The route translates into the chat path, so each answer is checked against the chat completion of the same
conversation (greedy: the same text, calls and token counts); streamed (`messages.stream`) against whole, and
the stream's event order against Anthropic's. A forced tool's input validates against its input_schema; a
tool_result round trip is answered as chat answers the tool message; stop_sequences end the text and are named.
Bad inputs are 400s in Anthropic's error shape naming the field, the decoder serving after.
"""
from __future__ import annotations

import json
from typing import Literal

import anthropic
import jsonschema
import pydantic
import pytest

from tests.decoder.text.tool_template import PARAMETERS, TOOLS
from tests.gateway.chat_fleet import KEY, MODEL, chat_fleet, still_up

ASK = "What is the weather in Paris, and the time in CET?"
SYSTEM = "You help with weather and time."
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tool_chat_model):
    with chat_fleet(tool_chat_model, tmp_path_factory.mktemp("messages"),
                    ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")) as f:
        yield {**f, "anthropic": anthropic.Anthropic(base_url=f["url"], api_key=KEY, max_retries=0, timeout=120)}


@pytest.fixture(scope="module")
def claude(fleet):
    return fleet["anthropic"]


def create(claude, **kw):
    kw.setdefault("max_tokens", 24)
    # This client has no temperature argument (Anthropic's newest models fix it); the route takes it, greedy here.
    kw.setdefault("extra_body", {"temperature": 0})
    return claude.messages.create(model=MODEL, messages=kw.pop("messages", [{"role": "user", "content": ASK}]),
                                  **kw)


def streamed(claude, **kw):
    """(event types in order, the final message) of messages.stream."""
    kw.setdefault("max_tokens", 24)
    kw.setdefault("extra_body", {"temperature": 0})
    types = []
    with claude.messages.stream(model=MODEL, messages=kw.pop("messages", [{"role": "user", "content": ASK}]),
                                **kw) as stream:
        for event in stream:
            if event.type in ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                              "message_delta", "message_stop", "ping"):
                types.append(event.type)
        return types, stream.get_final_message()


def raw_events(http, body: dict) -> list[str]:
    """The event names of a streamed answer on the wire (the client hides ping), each naming its data's type."""
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": ASK}], **body}
    names = []
    with http.stream("POST", "/v1/messages", json=body) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("event: "):
                names.append(line.removeprefix("event: "))
            elif line.startswith("data: "):
                assert json.loads(line.removeprefix("data: "))["type"] == names[-1]
    return names


def blocks(message) -> list[tuple]:
    return [("text", b.text) if b.type == "text" else ("tool_use", b.name, b.input) for b in message.content]


def collapse(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if not (i and t == types[i - 1] == "content_block_delta")]


def prompt_tokens(message) -> int:
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_text_equals_chat_streams_and_counts(client, http, claude):
    whole = create(claude, system=SYSTEM)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_completion_tokens=24, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert blocks(whole) == [("text", chat.choices[0].message.content)]
    assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert prompt_tokens(whole) == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": ASK}])
    assert counted.input_tokens == prompt_tokens(whole)
    types, final = streamed(claude, system=[{"type": "text", "text": SYSTEM}])
    assert collapse(types) == ["message_start", "content_block_start", "content_block_delta",
                               "content_block_stop", "message_delta", "message_stop"]
    assert collapse(raw_events(http, {"system": SYSTEM})) == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert blocks(final) == blocks(whole) and final.stop_reason == whole.stop_reason
    assert prompt_tokens(final) == prompt_tokens(whole) and final.usage.cache_read_input_tokens > 0


def test_stream_message_start_counts_the_prompt(claude):
    """message_start carries the prompt's real counts (the decoder reports them on its first message): here a
    prompt the whole answer before it left in the prefix cache."""
    system = SYSTEM + " Answer in one line."
    whole = create(claude, system=system)
    with claude.messages.stream(model=MODEL, max_tokens=24, extra_body={"temperature": 0}, system=system,
                                messages=[{"role": "user", "content": ASK}]) as stream:
        start = next(event for event in stream if event.type == "message_start")
        final = stream.get_final_message()
    usage = start.message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt_tokens(whole)
    assert usage.cache_read_input_tokens > 0 and usage.output_tokens == 0
    assert (usage.input_tokens, usage.cache_read_input_tokens) == (final.usage.input_tokens,
                                                                   final.usage.cache_read_input_tokens)


def test_stop_sequences_end_the_text_and_are_named(claude):
    text = create(claude, max_tokens=24).content[0].text
    stop = text[6:9]
    assert stop.strip() and len(text) > 9
    whole = create(claude, max_tokens=24, stop_sequences=[stop, "never-written-zzz"])
    assert whole.stop_reason == "stop_sequence" and whole.stop_sequence == stop
    assert whole.content[0].text == text[:text.index(stop)]
    _, final = streamed(claude, max_tokens=24, stop_sequences=[stop])
    assert (final.stop_reason, final.stop_sequence, blocks(final)) == ("stop_sequence", stop, blocks(whole))


def test_forced_tool_use_streams_its_input(claude):
    choice = {"type": "tool", "name": "get_time"}
    whole = create(claude, tools=ANTHROPIC_TOOLS, tool_choice=choice, max_tokens=60)
    assert [b.type for b in whole.content] == ["tool_use"] and whole.stop_reason == "tool_use"
    use = whole.content[0]
    assert use.name == "get_time" and use.id
    jsonschema.validate(use.input, PARAMETERS["get_time"])
    types, final = streamed(claude, tools=ANTHROPIC_TOOLS, tool_choice=choice, max_tokens=60)
    assert types.count("content_block_delta") > 1          # the input streams as input_json_delta pieces
    assert blocks(final) == blocks(whole) and final.stop_reason == "tool_use"


def test_any_then_tool_result_round_trip(client, claude):
    first = create(claude, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                   max_tokens=80)
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and first.stop_reason == "tool_use"
    jsonschema.validate(uses[0].input, PARAMETERS[uses[0].name])
    conversation = [{"role": "user", "content": ASK}, {"role": "assistant", "content": first.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                  "content": "18C, sunny"}]}]
    second = create(claude, messages=conversation, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"})
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_completion_tokens=24, tools=TOOLS,
                                          tool_choice="none", messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": uses[0].id, "type": "function", "function": {
            "name": uses[0].name, "arguments": json.dumps(uses[0].input, ensure_ascii=False)}}]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "18C, sunny"}])
    assert blocks(second) == [("text", chat.choices[0].message.content)]
    assert prompt_tokens(second) == chat.usage.prompt_tokens


class Forecast(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]   # closed values: the random model's free strings would run past the budget
    sunny: bool


def test_output_config_format_parses(claude):
    parsed = claude.messages.parse(model=MODEL, max_tokens=60, output_format=Forecast, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": ASK}])
    assert isinstance(parsed.parsed_output, Forecast) and parsed.stop_reason == "end_turn", parsed.content
    _, final = streamed(claude, max_tokens=60, output_config={"format": {
        "type": "json_schema", "schema": Forecast.model_json_schema()}})
    assert Forecast.model_validate_json(final.content[0].text) == parsed.parsed_output


@pytest.mark.parametrize("extra, field", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"top_k": 2**40}, "top_k"),            # looser in the Messages model than in chat's: still a 400
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "https://example.com/cat.png"}}]}]}, "URL image sources"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": ANTHROPIC_TOOLS}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"output_config": {"effort": "high"}}, "output_config"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object", "not": {}}}}},
     "output_config"),
])
def test_refusals_in_anthropic_shape(fleet, extra, field):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": ASK}], **extra}
    body = {k: v for k, v in body.items() if v is not None}
    reply = fleet["http"].post("/v1/messages", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert field in error["error"]["message"], error
    if "max_tokens" in body:     # the client itself requires max_tokens
        with pytest.raises(anthropic.BadRequestError):
            fleet["anthropic"].messages.create(**{k: body.pop(k) for k in ("model", "messages", "max_tokens")},
                                               extra_body=body)
    still_up(fleet)


def test_x_api_key_and_the_anthropic_401(fleet):
    wrong = anthropic.Anthropic(base_url=fleet["url"], api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "authentication_error"
