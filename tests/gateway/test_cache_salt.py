"""cache_salt (vLLM's field) through the real gateway and decoder: requests with different salts never share a
prefix-cache block, so one tenant's usage.prompt_tokens_details.cached_tokens says nothing about another's
prompts, while requests with the same salt still hit; unsalted requests are unaffected; an empty salt is a 400
naming it."""
from __future__ import annotations

import pytest

from tests.gateway.chat_fleet import MODEL, chat_fleet, wait_idle

BLOCK = 4
SECRET = [{"role": "user", "content": "The launch code is " + "seven tulips under the north bridge " * 6}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_chat_model):
    with chat_fleet(tiny_chat_model, tmp_path_factory.mktemp("logs")) as f:   # its decoder: --block-size 4
        yield f


def cached(client, salt: str | None = None, **extra) -> tuple[int, int]:
    body = {"cache_salt": salt} if salt is not None else {}
    reply = client.chat.completions.create(model=MODEL, messages=SECRET, max_tokens=1, temperature=0,
                                           extra_body=body, **extra)
    return reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens


def test_salts_isolate_the_prefix_cache(client, fleet):
    # An unsalted neighbour sends the secret first: its blocks are cached for unsalted requests only.
    first, prompt = cached(client)
    again, _ = cached(client)
    full = (prompt - 1) // BLOCK * BLOCK
    assert again >= full - BLOCK > first          # unsalted requests share, as before
    assert cached(client, "tenant-a")[0] == 0     # nothing of the unsalted blocks, not even the template's
    assert cached(client, "tenant-a")[0] >= full - BLOCK     # the same salt hits its own blocks
    assert cached(client, "tenant-b")[0] == 0     # another salt sees nothing of tenant-a's
    completions = client.completions.create(model=MODEL, prompt="seven tulips under the north bridge " * 6,
                                            max_tokens=1, temperature=0, extra_body={"cache_salt": "tenant-c"})
    assert completions.usage.prompt_tokens_details is None or \
        not completions.usage.prompt_tokens_details.cached_tokens
    wait_idle(fleet)


def test_an_empty_salt_is_refused_naming_it(http):
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": SECRET, "max_tokens": 1,
                                                    "cache_salt": ""})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "cache_salt", reply.text
