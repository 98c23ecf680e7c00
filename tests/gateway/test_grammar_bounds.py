"""Bounded grammar compilation through the gateway: a crafted slow regex is a 400 naming the field sent, at
the decoder's compile deadline, while a json_object chat and a plain one beside it answer promptly; an
oversize schema is a 413 naming response_format, or tools for a forced call's schema."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.gateway.chat_fleet import MODEL, chat_fleet, still_up

SLOW = "[^0-9]{1,999}[0-9]{1,999}"   # 25 bytes, seconds to compile (tests/decoder/grammar/test_bounds.py)
ASK = [{"role": "user", "content": "Answer."}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_chat_model):
    with chat_fleet(tiny_chat_model, tmp_path_factory.mktemp("grammar-bounds"), (
            "--grammar-threads", "1", "--grammar-compile-timeout-s", "0.5", "--max-schema-bytes", "512",
            "--max-regex-bytes", "64")) as f:
        yield f


def chat(fleet, **body) -> tuple[int, dict, float]:
    start = time.monotonic()
    reply = fleet["http"].post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 6,
                                                             "temperature": 0, **body})
    return reply.status_code, reply.json(), time.monotonic() - start


def test_a_slow_regex_is_a_400_while_others_answer(fleet):
    with ThreadPoolExecutor(3) as pool:
        slow = pool.submit(chat, fleet, structured_outputs={"regex": SLOW})
        time.sleep(0.15)
        json_object = pool.submit(chat, fleet, response_format={"type": "json_object"})
        plain = pool.submit(chat, fleet)
        status, body, took = slow.result(timeout=60)
        for other in (json_object, plain):
            other_status, other_body, other_took = other.result(timeout=60)
            assert other_status == 200 and other_took < 2.0, (other_status, other_body, other_took)
    assert status == 400 and body["error"]["param"] == "structured_outputs", body
    assert "did not compile within 0.5 s" in body["error"]["message"] and took < 2.5, (body, took)
    status, body, took = chat(fleet, response_format={"type": "json_schema", "json_schema": {
        "name": "slow", "schema": {"type": "string", "pattern": SLOW}}})
    assert status in (200, 400) and took < 5.0      # a pattern in a schema is bounded the same way
    still_up(fleet)


def test_oversize_schemas_are_413_naming_the_field(fleet):
    big = {"type": "object", "properties": {"a": {"type": "string", "description": "x" * 600}}}
    status, body, _ = chat(fleet, response_format={"type": "json_schema", "json_schema": {"name": "big",
                                                                                           "schema": big}})
    assert status == 413 and body["error"]["param"] == "response_format", body
    assert "--max-schema-bytes" in body["error"]["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": big}}]
    status, body, _ = chat(fleet, tools=tools, tool_choice="required")
    assert status == 413 and body["error"]["param"] == "tools", body
    status, body, _ = chat(fleet, structured_outputs={"regex": "a" * 65})
    assert status == 413 and body["error"]["param"] == "structured_outputs", body
    still_up(fleet)
