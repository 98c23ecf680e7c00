"""What evaluation harnesses and serving benchmarks send, through the official `openai` client on the tiny chat
fleet: completions `echo` with `logprobs` and `max_tokens: 0` (lm-evaluation-harness's log-likelihood request)
answers the prompt's own token logprobs, equal to transformers' on the same prompt (the first token's null);
echo before generated text, whole and streamed; vLLM's `prompt_logprobs` on completions and chat; and vLLM's
`ignore_eos`, which lets a choice run past the EOS it samples."""
from __future__ import annotations

import json

import pytest
import torch

from tests.gateway.chat_fleet import MODEL, still_up
from tests.tolerance import assert_close

PROMPT = "The capital of France is Paris, and the capital of Italy is"
EOS = 2   # the tiny chat model's (tests/decoder/server/conftest.py)


def reference_logprobs(folder, ids: list[int], top: int) -> tuple[list[float], list[dict[int, float]]]:
    """transformers' logprob of each prompt token after the first, and the top alternatives at each."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    picked = [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]
    tops = []
    for i in range(1, len(ids)):
        values, indices = logprobs[i - 1].topk(top)
        tops.append(dict(zip(indices.tolist(), values.tolist(), strict=True)))
    return picked, tops


def test_echo_prompt_logprobs_equal_transformers(client, http, tiny_chat_model):
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]
    reply = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    choice = reply.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == PROMPT and lp.text_offset[0] == 0
    expected, tops = reference_logprobs(tiny_chat_model, ids, 3)
    assert_close(lp.token_logprobs[1:], expected, k=128, depth=2, what="prompt logprobs")
    for got, want in zip(lp.top_logprobs[1:], tops, strict=True):
        assert len(got) == 3
        assert_close(sorted(got.values()), sorted(want.values()), k=128, depth=2, what="top logprobs")
    # A token-id prompt scores the same.
    by_ids = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    assert by_ids.choices[0].text == PROMPT
    assert by_ids.choices[0].logprobs.token_logprobs[0] is None
    # (Not bit-equal: a text and an id prompt may prefill beside different requests.)
    assert_close(by_ids.choices[0].logprobs.token_logprobs[1:], expected, k=128, depth=2, what="by ids")


def test_echo_then_generated_text(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                                       echo=True)
    text = plain.choices[0].text
    assert echoed.choices[0].text == PROMPT + text
    lp = echoed.choices[0].logprobs
    assert_close(lp.token_logprobs[-4:], plain.choices[0].logprobs.token_logprobs, k=128, depth=2)
    assert lp.text_offset[-4] == len(PROMPT)
    no_logprobs = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True)
    assert no_logprobs.choices[0].text == PROMPT and no_logprobs.choices[0].logprobs is None


def test_echo_streams_as_it_answers_whole(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    text, tokens, values, offsets = "", [], [], []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                text += choice["text"]
                tokens += choice["logprobs"]["tokens"]
                values += choice["logprobs"]["token_logprobs"]
                offsets += choice["logprobs"]["text_offset"]
    assert text == whole["text"] and text.startswith(PROMPT)
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]
    assert values[0] is None and whole["logprobs"]["token_logprobs"][0] is None
    assert_close(values[1:], whole["logprobs"]["token_logprobs"][1:], k=128, depth=2)


def test_vllm_prompt_logprobs(http, tiny_chat_model):
    """vLLM's prompt_logprobs: per prompt token a dict id -> {logprob, rank, decoded_token} with the prompt token
    and the top alternatives, the first null; on each completion choice (n = 2 too), on a chat answer."""
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]
    expected, tops = reference_logprobs(tiny_chat_model, ids, 2)
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "n": 2,
                                               "prompt_logprobs": 2}).json()
    for choice in reply["choices"]:
        scores = choice["prompt_logprobs"]
        assert len(scores) == len(ids) and scores[0] is None
        got = [entry[str(token)]["logprob"] for entry, token in zip(scores[1:], ids[1:], strict=True)]
        assert_close(got, expected, k=128, depth=2, what="prompt_logprobs")
        for entry, want, token in zip(scores[1:], tops, ids[1:], strict=True):
            top = sorted((v for v in entry.values() if v["rank"] <= 2), key=lambda v: v["rank"])
            assert [v["rank"] for v in top] == [1, 2]
            assert_close([v["logprob"] for v in top], sorted(want.values(), reverse=True), k=128, depth=2)
            assert entry[str(token)]["rank"] >= 1 and all(isinstance(v["decoded_token"], str) for v in entry.values())
    assert reply["usage"]["completion_tokens"] == 4
    alone = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 0,
                                               "prompt_logprobs": 0}).json()
    assert alone["choices"][0]["text"] == "" and alone["usage"]["completion_tokens"] == 0
    assert [list(e) for e in alone["choices"][0]["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "prompt_logprobs": 1,
                                                   "messages": [{"role": "user", "content": PROMPT}]}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_ignore_eos_runs_past_eos(client, fleet):
    forced = {"logit_bias": {str(EOS): 100}, "temperature": 0}
    stops = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, extra_body=forced)
    assert stops.choices[0].finish_reason == "stop" and stops.usage.completion_tokens == 1
    runs = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                     extra_body={**forced, "ignore_eos": True})
    assert runs.choices[0].finish_reason == "length" and runs.usage.completion_tokens == 5
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=5, extra_body={**forced, "ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    still_up(fleet)


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1000}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 1000, "max_tokens": 0}, "logprobs"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_refusals(http, fleet, body, field):
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
    still_up(fleet)
