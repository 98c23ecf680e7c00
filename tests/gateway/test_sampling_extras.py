"""The sampling extras end to end (gateway -> decoder) through the official `openai` client: logit_bias, top_k,
min_p, repetition_penalty, min_tokens, stop_token_ids, and the no-op fields store/metadata/service_tier.

The model's weights are random, so the checks use what the extras force: logit_bias +100 makes one token
the greedy choice at every step, which lets min_tokens, stop_token_ids, stop strings and the repetition
penalty be checked exactly. Their numerics against transformers' processors live in
tests/decoder/runner/test_sampler.py; here each field is shown to be wired and every bad value to be a
clear 400 that leaves the decoder serving.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from tokenizers import Tokenizer

from tests.gateway.chat_fleet import MAX_LEN, MODEL, still_up, wait_idle

EOS = 2      # the tiny chat model's eos (<|im_end|> in SmolLM2's vocabulary)
PROMPT = "Once upon a time"
HELLO = [{"role": "user", "content": "Tell me something."}]


@pytest.fixture(scope="module")
def word(tiny_chat_model):
    """(id, text) of a one-token word that is neither in PROMPT nor in HELLO."""
    ids = Tokenizer.from_file(str(tiny_chat_model / "tokenizer.json")).encode(" banana", add_special_tokens=False).ids
    assert len(ids) == 1
    return ids[0], " banana"


def complete(client, **kw):
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=kw.pop("prompt", PROMPT), **kw).choices[0]


def test_logit_bias_forces_and_bans_tokens(client, fleet, word):
    token, text = word
    assert complete(client, logit_bias={str(token): 100}).text == text * 6
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=4, temperature=0,
                                          logit_bias={str(token): 100})
    assert chat.choices[0].message.content == text * 4
    plain = complete(client, max_tokens=1, logprobs=1)
    first = plain.logprobs.tokens[0]
    banned = complete(client, max_tokens=1, logprobs=1,
                      extra_body={"logit_bias": {str(_id(fleet, first)): -100}})
    assert banned.logprobs.tokens[0] != first
    # Logprobs stay the raw model's: the banned token is still the most likely one there.
    assert max(banned.logprobs.top_logprobs[0], key=banned.logprobs.top_logprobs[0].get) == first


def _id(fleet, token_text: str) -> int:
    reply = fleet["http"].post("/tokenize", json={"model": MODEL, "prompt": token_text, "add_special_tokens": False})
    ids = reply.json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def test_top_k_1_and_min_p_1_are_greedy(client):
    greedy = complete(client, max_tokens=8).text
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        for seed in (1, 2):
            assert complete(client, max_tokens=8, temperature=1.0, seed=seed, extra_body=extra).text == greedy, extra
    # -1 and 0 both disable top_k (vLLM): the same seeded draw as without it.
    free = complete(client, max_tokens=8, temperature=1.0, seed=3).text
    assert complete(client, max_tokens=8, temperature=1.0, seed=3, extra_body={"top_k": -1}).text == free
    assert complete(client, max_tokens=8, temperature=1.0, seed=3, extra_body={"top_k": 0}).text == free
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=5, temperature=1.0,
                                          seed=4, extra_body={"top_k": 1, "min_p": 0.5})
    assert chat.choices[0].message.content == client.chat.completions.create(
        model=MODEL, messages=HELLO, max_completion_tokens=5, temperature=0).choices[0].message.content


def test_repetition_penalty_applies_after_the_bias(client, word):
    token, text = word
    # +30 makes the word greedy; a penalty of 100 divides its (positive, biased) logit once it was generated,
    # so it cannot repeat. Were the penalty applied before the bias, the +30 would win every step.
    out = complete(client, max_tokens=4, logit_bias={str(token): 30}, extra_body={"repetition_penalty": 100.0})
    assert out.text.startswith(text) and text not in out.text[len(text):]
    assert complete(client, max_tokens=4, logit_bias={str(token): 30},
                    extra_body={"repetition_penalty": 1.0}).text == text * 4


def test_min_tokens_holds_eos_stop_token_ids_and_stop_strings(client, word):
    token, text = word
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                    logit_bias={str(EOS): 100})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == "" and out.usage.completion_tokens == 1
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                    logit_bias={str(EOS): 100}, extra_body={"min_tokens": 4})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 5
    bias = {str(token): 100}
    out = complete(client, max_tokens=10, logit_bias=bias, extra_body={"stop_token_ids": [token]})
    assert (out.text, out.finish_reason) == ("", "stop")
    # Blocked for two tokens, then chosen: it ends the choice as the third.
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=bias,
                                    extra_body={"stop_token_ids": [token], "min_tokens": 2})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 3
    assert out.choices[0].text and text not in out.choices[0].text
    # A stop string in the first min_tokens tokens does not end the choice (vLLM: only later text is searched).
    out = complete(client, max_tokens=10, logit_bias=bias, stop=[text])
    assert (out.text, out.finish_reason) == ("", "stop")
    out = complete(client, max_tokens=10, logit_bias=bias, stop=[text], extra_body={"min_tokens": 3})
    assert (out.text, out.finish_reason) == (text * 3, "stop")
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=10, temperature=0,
                                          logit_bias=bias, stop=[text], extra_body={"min_tokens": 2})
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == (text * 2, "stop")
    # Streamed, the same.
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=bias,
                                         stop=[text], stream=True, extra_body={"min_tokens": 3})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text * 3


EXTRAS = {"top_k": 30, "min_p": 0.02, "repetition_penalty": 1.3, "min_tokens": 3}


def test_seeded_extras_reproduce_alone_and_in_a_mixed_batch(client):
    def ask(seed: int, **extra):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.95,
                                         seed=seed, logit_bias={"5": 3}, extra_body={**EXTRAS, **extra}
                                         ).choices[0].text
    alone = ask(11)
    assert ask(11) == alone
    others = [dict(seed=12, repetition_penalty=2.0), dict(seed=13, top_k=2), dict(seed=14, min_p=0.3)]
    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            futures = [pool.submit(ask, 11)] + [pool.submit(ask, **o) for o in others]
            assert futures[0].result() == alone
            [f.result() for f in futures[1:]]


def test_no_op_fields_are_accepted_and_change_nothing(client, fleet):
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=5, temperature=0)
    same = client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=5, temperature=0,
                                          store=False, metadata={"team": "search", "run": "7"}, service_tier="auto",
                                          user="someone")
    assert same.choices[0].message.content == plain.choices[0].message.content
    text = complete(client).text
    assert complete(client, extra_body={"store": False, "metadata": {"a": "b"}, "service_tier": "auto"}).text == text
    wait_idle(fleet)


LONG = "x" * 513
BAD = [
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"5.0": 1}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 6, "max_tokens": 5}, "min_tokens"),
    ({"min_tokens": MAX_LEN}, "min_tokens"),
    ({"stop_token_ids": [49152]}, "stop_token_ids"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids"),
    ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"service_tier": "default"}, "service_tier"),
    ({"metadata": {"k": LONG}}, "metadata"),
    ({"metadata": {"k": 5}}, "metadata"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_extras_are_a_400_naming_the_field(fleet, extra, param):
    http = fleet["http"]
    for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 5}),
                       ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 5})):
        body = {**body, **extra}
        if path.endswith("chat/completions") and "max_tokens" in extra:
            body["max_completion_tokens"] = body.pop("max_tokens")
        reply = http.post(path, json=body)
        assert reply.status_code == 400, reply.text
        err = reply.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param, err
    still_up(fleet)


def test_openai_client_sees_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=HELLO, logit_bias={"5": 500})
    assert "logit_bias" in str(exc.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HELLO, store=True)
