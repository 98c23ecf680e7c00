"""Tool calls end to end (gateway -> decoder) through the official `openai` client, on a tiny random Qwen2 with a
hermes tool template (tests/gateway/tool_model.py) served with --enable-auto-tool-choice --tool-call-parser hermes.

The model's words are noise, so under tool_choice "required" and a named function every valid call is the
grammar's doing: the calls must parse and validate against their function's parameters (jsonschema), streamed
and whole alike, greedy and seeded, n=2. Under "auto" the random model writes what it likes, so the checks are
agreement (stream == whole) and that the tools reached the prompt. A round trip with an assistant's
tool_calls and a tool message is answered and rendered by the model's template. Every bad input is a 400
naming its field, with the decoder serving afterwards; a template without tools refuses auto at start.
"""
from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

from tests.conftest import free_port
from tests.decoder.text.tool_template import PARAMETERS, TOOLS, WEATHER
from tests.gateway.chat_fleet import MODEL, chat_fleet, still_up, wait_idle
from tests.gateway.fleet import ROOT

ASK = [{"role": "system", "content": "You help with weather and time."},
       {"role": "user", "content": "What is the weather in Paris, and the time in CET?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tool_chat_model):
    with chat_fleet(tool_chat_model, tmp_path_factory.mktemp("tools"),
                    ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")) as f:
        yield f


def chat(client, **kw):
    kw.setdefault("max_completion_tokens", 160)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), tools=kw.pop("tools", TOOLS),
                                          **kw)


def valid(calls) -> list[tuple[str, str]]:
    """[(name, arguments)] of OpenAI tool calls, each checked against its function's parameters."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_"), call
        name, arguments = call.function.name, call.function.arguments
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])
        out.append((name, arguments))
    return out


def streamed(client, **kw) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of a streamed answer, checking OpenAI's delta shape: a call's
    first delta has index, id, type and name (arguments ""), later ones only argument pieces."""
    content, calls, reason = "", {}, None
    for chunk in chat(client, stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            if d.index not in calls:
                assert d.index == len(calls) and d.id.startswith("call_") and d.type == "function", d
                assert d.function.name and d.function.arguments == "", d
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.id is None and d.type is None and d.function.name is None, d
                calls[d.index][1] += d.function.arguments
        reason = choice.finish_reason or reason
    return content, [tuple(c) for c in calls.values()], reason


def test_required_forces_valid_calls_streamed_and_whole(client):
    whole = chat(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    calls = valid(whole.message.tool_calls)
    assert whole.finish_reason == "tool_calls" and whole.message.content is None and len(calls) == 1
    assert streamed(client, tool_choice="required", parallel_tool_calls=False) == ("", calls, "tool_calls")


def test_parallel_calls_until_the_model_closes_the_array(client):
    # Greedy, the random model opens call after call until max_tokens: every finished call is valid, the cut
    # one is the last, and it ends with finish_reason length. Streamed deltas give the same calls.
    whole = chat(client, tool_choice="required").choices[0]
    made = whole.message.tool_calls
    assert len(made) > 1 and whole.finish_reason == "length"
    calls = valid(made[:-1])
    content, stream_calls, reason = streamed(client, tool_choice="required")
    assert (content, stream_calls[:-1], reason) == ("", calls, "length")
    assert stream_calls[-1] == (made[-1].function.name, made[-1].function.arguments)
    # Seeded, it closes the array itself: then every call is valid and the choice ends with tool_calls.
    closed = [chat(client, tool_choice="required", temperature=1.0, seed=seed).choices[0] for seed in range(6)]
    closed = [c for c in closed if c.finish_reason == "tool_calls"]
    assert closed and all(valid(c.message.tool_calls) for c in closed)


def test_required_with_seeds_and_n(client):
    seen = set()
    for seed in (1, 2, 3):
        reply = chat(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed, n=2)
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls"
            seen.update(valid(choice.message.tool_calls))
    assert len(seen) > 1                 # sampling still varies inside the grammar
    again = chat(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=2, n=2)
    first = chat(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=2, n=2)
    assert [valid(c.message.tool_calls) for c in again.choices] == [valid(c.message.tool_calls) for c in first.choices]


def test_a_named_function_is_called(client):
    whole = chat(client, tool_choice=NAMED).choices[0]
    calls = valid(whole.message.tool_calls)
    assert [name for name, _ in calls] == ["get_time"] and whole.finish_reason == "tool_calls"
    assert streamed(client, tool_choice=NAMED) == ("", calls, "tool_calls")
    for seed in (4, 5):
        choice = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                      temperature=1.0, seed=seed).choices[0]
        assert [name for name, _ in valid(choice.message.tool_calls)] == ["get_weather"]


def test_a_cut_call_ends_with_length(client):
    cut = chat(client, tool_choice=NAMED, max_completion_tokens=3).choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls[0].function.name == "get_time"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.message.tool_calls[0].function.arguments)


def test_auto_on_a_random_model_agrees_streamed_and_whole(client, fleet):
    for parallel in (True, False):
        whole = chat(client, parallel_tool_calls=parallel, max_completion_tokens=48).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
        content = whole.message.content or ""
        assert streamed(client, parallel_tool_calls=parallel, max_completion_tokens=48) == (
            content, calls, whole.finish_reason)
        assert whole.finish_reason in ("stop", "length", "tool_calls")
    # The tools reached the prompt: it is the template's rendering with them, as /tokenize counts it.
    usage = chat(client, max_completion_tokens=1).usage
    count = fleet["http"].post("/tokenize", json={"messages": ASK, "tools": TOOLS}).json()["count"]
    bare = fleet["http"].post("/tokenize", json={"messages": ASK}).json()["count"]
    assert usage.prompt_tokens == count > bare


def test_none_answers_in_text(client):
    choice = chat(client, tool_choice="none", max_completion_tokens=24).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert streamed(client, tool_choice="none", max_completion_tokens=24) == (
        choice.message.content, [], choice.finish_reason)


def test_round_trip_with_a_tool_message(client, fleet):
    first = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    call = first.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    for choice in ("auto", "none", "required"):
        answer = chat(client, messages=conversation, tool_choice=choice, max_completion_tokens=24).choices[0]
        assert answer.finish_reason in ("stop", "length", "tool_calls")
    # The agent-loop habit: the answer's message object itself goes back into the conversation.
    again = chat(client, messages=[*ASK, first.message, conversation[-1]], max_completion_tokens=8)
    assert again.usage.prompt_tokens == chat(client, messages=conversation, max_completion_tokens=8).usage.prompt_tokens
    # The decoder rendered the call and the answer with the model's own template.
    tokens = fleet["http"].post("/tokenize", json={"messages": conversation, "tools": TOOLS}).json()["tokens"]
    prompt = fleet["http"].post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    rendered = json.dumps({"name": "get_weather", "arguments": arguments}, ensure_ascii=False)
    assert f"<tool_call>\n{rendered}\n</tool_call>" in prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt
    wait_idle(fleet)


def test_models_list_the_parser(fleet):
    card = fleet["http"].get(f"/v1/models/{MODEL}").json()
    assert card["tool_call_parser"] == "hermes"


TOOL = TOOLS[0]
BAD = [
    ({"tools": []}, "tools", "at least 1"),
    ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools"),
    ({"tool_choice": "none"}, "tool_choice", "only allowed when tools"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls", "only allowed when tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "not in tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice", "function"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]}, "tools",
     "not a valid JSON Schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     "type: object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools", "dict"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "pattern"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "function"),
    ({"tools": [TOOL, TOOL]}, "tools", "more than once"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": WEATHER}}]}, "tools",
     "strict"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "second constraint"),
    ({"tools": [TOOL], "structured_outputs": {"regex": "a+"}}, "structured_outputs", "rule out"),
    # Forced, the parameters become a grammar: what the decoder refuses names tools.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"allOf": [{"type": "object"}]}}}],
      "tool_choice": "required"}, "tools", "allOf"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools", "does not compile"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "21", "tool_call_id": "nope"}]},
     "messages", "answers no tool call"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages", "not valid JSON"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}]}, "messages", "only assistant"),
    ({"messages": [{"role": "assistant"}]}, "messages", "content is required"),
]


@pytest.mark.parametrize("extra, param, says", BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_bad_inputs_are_a_400_naming_the_field(fleet, extra, param, says):
    for stream in (False, True):
        reply = fleet["http"].post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, "stream": stream,
                                                                 **extra})
        assert reply.status_code == 400, reply.text
        err = reply.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and says in err["message"], err


def test_the_decoder_is_healthy_after_the_refusals(fleet, client):
    still_up(fleet)
    valid(chat(client, tool_choice="required", parallel_tool_calls=False).choices[0].message.tool_calls)


def test_a_template_without_tools_refuses_auto_at_start(tiny_chat_model):
    """SmolLM2's template (what `make up` serves) renders no tools: --enable-auto-tool-choice is a start error."""
    done = subprocess.run([sys.executable, "-m", "services.decoder", "--model", str(tiny_chat_model), "--port",
                           str(free_port()), "--num-blocks", "16", "--threads", "1", "--enable-auto-tool-choice",
                           "--tool-call-parser", "hermes", "--insecure-no-auth"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "does not render tools" in done.stderr + done.stdout, done.stderr[-2000:]
