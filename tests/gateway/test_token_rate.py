"""Per-tenant token rates (gateway/limits.py, --max-tokens-per-minute-per-key) over real HTTP: a decoder
subprocess on the tiny chat model behind a gateway with a budget of BUDGET tokens a minute. A key that spent
its budget gets 429 with Retry-After, in OpenAI's shape and in Anthropic's on /v1/messages, while another key
still gets through; a stream's usage is debited when it ends, also when its client leaves midway; with the
flag off nothing is refused. And the bucket's arithmetic, on a fake clock.
"""
from __future__ import annotations

import time

import httpx
import pytest

from gateway.config import GatewayConfig
from gateway.limits import TokenBuckets
from tests.conftest import free_port
from tests.gateway.chat_fleet import chat_fleet
from tests.gateway.fleet import GatewayThread
from tests.pooling.conftest import RunningServer, minilm_dir, tiny_bert_dir  # noqa: F401 - fixtures

KEYS = ("sk-rate-tenant-a", "sk-rate-tenant-b", "sk-rate-tenant-c", "sk-rate-tenant-d")
BUDGET = 50   # tokens a minute: one SPEND overdraws it
HELLO = [{"role": "user", "content": "Hello, who are you?"}]
SPEND = {"messages": HELLO, "max_tokens": 40, "ignore_eos": True}   # the prompt (~30 tokens) + 40
QUICK = {"messages": HELLO, "max_tokens": 2}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_chat_model):
    with chat_fleet(tiny_chat_model, tmp_path_factory.mktemp("rate"),
                    gateway={"api_key": ",".join(KEYS), "max_tokens_per_minute_per_key": BUDGET}) as f:
        yield f


def post(url: str, key: str, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def spent(response: httpx.Response) -> int:
    usage = response.json()["usage"]
    return usage["prompt_tokens"] + usage["completion_tokens"]


def assert_refused(response: httpx.Response, overdraft: int | None = None) -> None:
    """A 429 in OpenAI's shape whose Retry-After is the wait for a bucket overdrawn by overdraft tokens."""
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    wait = int(response.headers["retry-after"])
    assert wait >= 1
    if overdraft is not None:
        # Refilled at BUDGET / 60 a second since the debit: a few seconds of slack for a slow machine.
        assert overdraft * 60 / BUDGET - 5 <= wait <= overdraft * 60 / BUDGET + 1, (wait, overdraft)


def test_a_key_that_spent_its_budget_waits_while_another_does_not(fleet):
    url = fleet["url"]
    first = post(url, KEYS[0], SPEND)
    assert first.status_code == 200, first.text
    assert spent(first) > BUDGET
    assert_refused(post(url, KEYS[0], QUICK), spent(first) - BUDGET)
    # Anthropic's route answers in Anthropic's shape.
    refused = post(url, KEYS[0], {"model": "tiny-chat", "max_tokens": 2, "messages": HELLO}, "/v1/messages")
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "rate_limit_error"
    # Unmetered routes stay open to it.
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 200
    assert post(url, KEYS[1], QUICK).status_code == 200


def test_a_stream_is_debited_when_it_ends(fleet):
    url = fleet["url"]
    body = {**SPEND, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEYS[2]}"}) as response:
        assert response.status_code == 200
        usage = [line for line in response.iter_lines() if '"usage": {' in line or '"usage":{' in line]
    assert usage, "the stream ended without its usage chunk"
    assert_refused(post(url, KEYS[2], QUICK))


def test_a_stream_whose_client_leaves_is_debited_what_it_streamed(fleet):
    url = fleet["url"]
    body = {"messages": HELLO, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEYS[3]}"}) as response:
        assert response.status_code == 200
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: {")
            if chunks > BUDGET + 10:
                break   # leaves: closing the response drops the connection
    # The gateway notices the client gone, cancels the generation and debits what was streamed.
    deadline = time.monotonic() + 20
    while (answer := post(url, KEYS[3], QUICK)).status_code == 200:
        assert time.monotonic() < deadline, "a stream cut by its client was never debited"
        time.sleep(0.5)
    assert_refused(answer)


def test_without_the_flag_nothing_is_refused(fleet):
    cfg = GatewayConfig(host="127.0.0.1", port=free_port(), decoder=(fleet["address"],), api_key=KEYS[0])
    with GatewayThread(cfg) as gateway:
        for _ in range(3):
            answer = post(gateway.url, KEYS[0], SPEND)
            assert answer.status_code == 200, answer.text
            assert spent(answer) > BUDGET


@pytest.fixture(scope="module")
def pooling(tiny_bert_dir):  # noqa: F811 - the imported fixture
    running = RunningServer(embedding_model=str(tiny_bert_dir), embedding_name="tiny")
    yield running
    running.close()


def test_embeddings_spend_their_prompt_tokens(pooling):
    cfg = GatewayConfig(host="127.0.0.1", port=free_port(), pooling=f"127.0.0.1:{pooling.port}",
                        api_key=",".join(KEYS[:2]), max_tokens_per_minute_per_key=BUDGET)
    body = {"input": ["one two three four five six seven eight nine ten"] * 6}
    with GatewayThread(cfg) as gateway:
        first = post(gateway.url, KEYS[0], body, "/v1/embeddings")
        assert first.status_code == 200, first.text
        overdraft = first.json()["usage"]["prompt_tokens"] - BUDGET
        assert overdraft > 0
        assert_refused(post(gateway.url, KEYS[0], {"input": "one"}, "/v1/embeddings"), overdraft)
        assert post(gateway.url, KEYS[1], {"input": "one"}, "/v1/embeddings").status_code == 200


def test_bucket_refills_continuously_up_to_a_minutes_tokens():
    now = [0.0]
    buckets = TokenBuckets(60, clock=lambda: now[0])   # one token a second
    assert buckets.wait_s("t") == 0
    buckets.debit("t", 90)                 # overdrawn by 30
    assert buckets.wait_s("t") == 31       # positive after 30 s, so the 31st
    assert buckets.wait_s("other") == 0    # tenants are apart
    now[0] = 30.5
    assert buckets.wait_s("t") == 0
    now[0] = 1000.0
    assert buckets.level("t") == 60        # capped at a minute's tokens
    assert not buckets.levels              # a full bucket takes no memory
