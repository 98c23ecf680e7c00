"""Stored responses (`store`, `previous_response_id`, GET and DELETE /v1/responses/{id}) in a private Redis,
through the official `openai` client, on the tiny hermes tool model (tests/gateway/tool_model.py).

The gateway runs without an API key of its own, so each client's key names its tenant (as behind an
authenticating proxy): one key's ids are 404s to another. A continuation carries every earlier item, function
calls and their outputs included (its answer equals the chat answer of the whole conversation), and its prompt
is a prefix-cache hit. `store: false` stores nothing; the byte budget evicts a key's oldest; with Redis down a
stored request is a 503 naming the store before any generation, and `store: false` still answers.
"""
from __future__ import annotations

import json

import openai
import pytest

from tests.conftest import free_port
from tests.decoder.text.tool_template import TOOLS
from tests.gateway.chat_fleet import MODEL, chat_fleet, still_up
from tests.gateway.fleet import redis_process, stop

ASK = "What is the weather in Paris, and the time in CET?"
FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]
BUDGET = 16 * 1024


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tool_chat_model):
    port = free_port()
    redis = redis_process(port, tmp_path_factory.mktemp("redis"))
    try:
        with chat_fleet(tool_chat_model, tmp_path_factory.mktemp("store"),
                        ("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
                        {"api_key": None, "response_store": f"redis://127.0.0.1:{port}/0",
                         "response_store_max_bytes": BUDGET}) as f:
            keyed = {key: openai.OpenAI(base_url=f["url"] + "/v1", api_key=key, max_retries=0, timeout=120)
                     for key in ("sk-alice", "sk-bob")}
            yield {**f, "alice": keyed["sk-alice"], "bob": keyed["sk-bob"], "redis": redis}
    finally:
        stop(redis)


def respond(client, **kw):
    kw.setdefault("max_output_tokens", 16)
    kw.setdefault("temperature", 0)
    return client.responses.create(model=MODEL, input=kw.pop("input", ASK), **kw)


def test_continuation_carries_calls_and_hits_the_prefix_cache(fleet):
    alice = fleet["alice"]
    first = respond(alice, tools=FUNCTIONS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=80)
    assert first.store is True
    call = next(i for i in first.output if i.type == "function_call")
    assert alice.responses.retrieve(first.id).output[0].call_id == call.call_id
    second = respond(alice, previous_response_id=first.id, tools=FUNCTIONS, tool_choice="none",
                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C, sunny"}])
    assert second.previous_response_id == first.id
    chat = alice.chat.completions.create(model=MODEL, temperature=0, max_completion_tokens=16, tools=TOOLS,
                                         tool_choice="none", messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18C, sunny"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # The first prompt (all but its partial last block of 4) is read from the prefix cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 4
    third = respond(alice, previous_response_id=second.id, input="And tomorrow?", stream=True, tools=FUNCTIONS,
                    tool_choice="none")
    final = [e for e in third][-1].response
    assert final.previous_response_id == second.id and final.usage.input_tokens > second.usage.input_tokens
    assert final.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 4


def test_another_key_cannot_read_continue_or_delete(fleet):
    mine = respond(fleet["alice"])
    for call in (lambda c: c.responses.retrieve(mine.id), lambda c: c.responses.delete(mine.id),
                 lambda c: respond(c, previous_response_id=mine.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            call(fleet["bob"])
        assert caught.value.body["code"] == "response_not_found"
    assert fleet["alice"].responses.retrieve(mine.id).output_text == mine.output_text
    fleet["alice"].responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        fleet["alice"].responses.retrieve(mine.id)


def test_cancel_is_a_400_for_a_stored_response_and_a_404_for_another_keys(fleet):
    """Only background runs can be cancelled, and the gateway runs none: the caller's own stored response is a
    400 naming it (OpenAI's answer for a foreground response), another key's or an unknown id a 404."""
    mine = respond(fleet["alice"])
    with pytest.raises(openai.BadRequestError) as caught:
        fleet["alice"].responses.cancel(mine.id)
    assert caught.value.body["param"] == "response_id" and "background" in caught.value.body["message"]
    for client, rid in ((fleet["bob"], mine.id), (fleet["alice"], "resp_never_made")):
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.cancel(rid)
        assert missing.value.body["code"] == "response_not_found"
    assert fleet["alice"].responses.retrieve(mine.id).status == mine.status


def test_store_false_keeps_nothing(fleet):
    unstored = respond(fleet["alice"], store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        fleet["alice"].responses.retrieve(unstored.id)


def test_budget_evicts_the_oldest(fleet):
    ids = [respond(fleet["bob"], input=f"Request {i}: " + "long words " * 150).id for i in range(6)]
    kept = []
    for rid in ids:
        try:
            kept.append(fleet["bob"].responses.retrieve(rid).id)
        except openai.NotFoundError:
            pass
    assert kept and kept == ids[len(ids) - len(kept):] and len(kept) < len(ids)
    held = sum(len(json.dumps(fleet["bob"].responses.retrieve(rid).model_dump())) for rid in kept)
    assert held <= 2 * BUDGET


def test_redis_down_is_a_503_naming_the_store(fleet):
    stop(fleet["redis"])
    reply = fleet["http"].post("/v1/responses", json={"model": MODEL, "input": ASK, "max_output_tokens": 4})
    assert reply.status_code == 503 and reply.json()["error"]["param"] == "store", reply.text
    unstored = respond(fleet["alice"], store=False, max_output_tokens=4)
    assert unstored.output_text is not None
    still_up(fleet)
