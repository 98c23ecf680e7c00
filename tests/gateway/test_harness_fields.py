"""What evaluation harnesses and serving benchmarks send, through the official `openai` client on the tiny chat
fleet: completions `echo` with `logprobs` and `max_tokens: 0` (lm-evaluation-harness's log-likelihood request)
answers the prompt's own token logprobs, equal to transformers' on the same prompt (the first token's null);
echo before generated text; and vLLM's `ignore_eos`, which lets a choice run past the EOS it samples."""
from __future__ import annotations

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
    # (Not bit-equal: the waves batch differently, and prefix-cache hits change which rows prefill together.)
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
    ({"echo": True, "stream": True}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True, "logprobs": 3, "max_tokens": 0, "prompt": [5] * 2049}, "prompt"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_refusals(http, fleet, body, field):
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
    still_up(fleet)
