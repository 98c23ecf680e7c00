"""The sampler on synthetic logits: greedy, seeds, top-k/top-p, penalties, logprobs."""
from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgument
from services.decoder.engine.step import SamplingParams, ScheduledChunk
from services.decoder.runner.sampler import Sampler, filter_logits
from tests.tolerance import assert_close

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

V = 50


def chunk(rid: str, sampling: SamplingParams, outputs: list[int] | None = None) -> ScheduledChunk:
    return ScheduledChunk(rid, [1], 0, [0], True, sampling, list(outputs or []))


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(n, V, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = logits_rows(4)
    out = Sampler(0)(logits, [chunk(str(i), SamplingParams(temperature=0)) for i in range(4)])
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()
    assert all(t.logprob is None for t in out)


def test_seeded_sampling_is_independent_of_batch():
    target = logits_rows(1, seed=1)[0]
    params = SamplingParams(temperature=1.3, top_p=0.95, top_k=20, seed=1234)
    outputs, alone = [], []
    for step in range(12):                       # the seed advances with the output length
        batch = torch.stack([logits_rows(1, seed=100 + step)[0], target, logits_rows(1, seed=200 + step)[0]])
        chunks = [chunk("x", SamplingParams(temperature=1.0)), chunk("t", params, outputs),
                  chunk("y", SamplingParams(temperature=0.7, seed=5))]
        in_batch = Sampler(step)(batch, chunks)[1].token_id
        alone.append(Sampler(999)(target[None], [chunk("t", params, outputs)])[0].token_id)
        assert in_batch == alone[-1]
        outputs.append(in_batch)
    assert len(set(outputs)) > 1, "the per-step seeds must differ"
    other = []
    for _ in range(12):
        other.append(Sampler(0)(target[None], [chunk("t", SamplingParams(temperature=1.3, top_p=0.95, top_k=20,
                                                                           seed=4321), other)])[0].token_id)
    assert other != outputs


def test_top_k_only_draws_from_the_k_best():
    logits = logits_rows(1, seed=3)[0]
    best = set(torch.topk(logits, 3).indices.tolist())
    drawn = {Sampler(0)(logits[None], [chunk("a", SamplingParams(temperature=5.0, top_k=3, seed=s))])[0].token_id
             for s in range(60)}
    assert drawn == best


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04])
    kept = torch.isfinite(filter_logits(probs.log(), 0, 0.8))
    assert kept.tolist() == [True, True, True, False, False]        # 0.5 + 0.25 < 0.8 <= 0.9
    kept = torch.isfinite(filter_logits(probs.log(), 0, 0.75))
    assert kept.tolist() == [True, True, False, False, False]       # reaching exactly top_p is enough
    kept = torch.isfinite(filter_logits(probs.log(), 0, 0.01))
    assert kept.tolist() == [True, False, False, False, False]      # the best token always stays
    kept = torch.isfinite(filter_logits(probs.log(), 2, 1.0))
    assert kept.tolist() == [True, True, False, False, False]


def test_penalties_follow_openai_formula():
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 8] = 2.0, 1.5
    outputs = [7, 7, 7, 9]
    # 7: 2.0 - 3*0.2 - 0.5 = 0.9 < 8's 1.5, so greedy switches to 8.
    p = SamplingParams(temperature=0, frequency_penalty=0.2, presence_penalty=0.5)
    assert Sampler(0)(logits, [chunk("a", p, outputs)])[0].token_id == 8
    p = SamplingParams(temperature=0, frequency_penalty=0.1, presence_penalty=0.1)  # 2.0 - 0.4 = 1.6 > 1.5
    assert Sampler(0)(logits, [chunk("a", p, outputs)])[0].token_id == 7
    # Negative penalties encourage repetition; a penalty never touches the logprobs (raw model).
    logits[0, 9] = 1.0
    p = SamplingParams(temperature=0, presence_penalty=-1.5, logprobs=0)
    out = Sampler(0)(logits, [chunk("a", p, [9])])[0]                # 9: 1.0 + 1.5 = 2.5 > 2.0
    assert out.token_id == 9
    assert_close(out.logprob, torch.log_softmax(logits[0], -1)[9], k=logits.shape[-1])


def test_logprobs_are_raw_log_softmax_sorted():
    logits = logits_rows(2, seed=9)
    params = [SamplingParams(temperature=0.8, seed=3, logprobs=5), SamplingParams(temperature=0, logprobs=0)]
    out = Sampler(0)(logits, [chunk("a", params[0]), chunk("b", params[1])])
    ref = torch.log_softmax(logits, -1)
    assert_close(ref[0].double().exp().sum(), 1.0, k=logits.shape[-1])
    a = out[0]
    assert_close(a.logprob, ref[0, a.token_id], k=logits.shape[-1])
    assert [i for i, _ in a.top_logprobs] == torch.topk(ref[0], 5).indices.tolist()
    values = [v for _, v in a.top_logprobs]
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    assert out[1].top_logprobs == [] and out[1].token_id == int(logits[1].argmax())


def test_invalid_sampling_is_refused():
    logits = logits_rows(1)
    with pytest.raises(InvalidArgument, match="temperature"):
        Sampler(0)(logits, [chunk("a", SamplingParams(temperature=-1))])
    with pytest.raises(InvalidArgument, match="top_p"):
        Sampler(0)(logits, [chunk("a", SamplingParams(top_p=0.0))])
