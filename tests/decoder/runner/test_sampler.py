"""The sampler on synthetic logits: greedy, seeds, top-k/top-p, penalties, logprobs, and the extras
(logit_bias, min_p, repetition_penalty, blocked stop tokens) against transformers' logits processors."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from services.common.errors import InvalidArgument
from services.decoder.engine.step import SamplingParams, ScheduledChunk
from services.decoder.runner.sampler import Sampler, categorical, filter_logits, process_logits, warp_logits
from tests.tolerance import assert_close

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

V = 50


def chunk(rid: str, sampling: SamplingParams, outputs: list[int] | None = None, prompt: tuple[int, ...] = (),
          blocked: tuple[int, ...] = ()) -> ScheduledChunk:
    return ScheduledChunk(rid, [1], 0, [0], True, sampling, list(outputs or []), prompt_token_ids=prompt,
                          blocked_token_ids=blocked)


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(n, V, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = logits_rows(4)
    out = Sampler(0)(logits, [chunk(str(i), SamplingParams(temperature=0)) for i in range(4)])
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()
    assert all(t.logprob is None for t in out)


def test_greedy_takes_the_first_of_tied_maxima():
    """The sampler's argmax is max(dim).indices: the first index of a tie, as torch.argmax, and a NaN's."""
    logits = torch.zeros(3, 49152)
    logits[0, [7, 9, 40000]] = 5.0           # a three-way tie
    logits[1, [3, 20000]] = float("inf")
    logits[2, 11] = 1.0
    logits[2, 30000] = float("nan")
    out = Sampler(0)(logits, [chunk(str(i), SamplingParams(temperature=0)) for i in range(3)])
    assert [t.token_id for t in out] == [7, 3, 30000] == logits.argmax(-1).tolist()


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


def test_categorical_draws_follow_the_probabilities():
    """Chi-square over 20,000 seeded draws (df = 4 non-zero entries - 1): the inverse-CDF draw
    matches its probabilities and never returns a zero entry; a uniform pick fails the same bound."""
    from scipy.stats import chi2
    probs = torch.tensor([0.5, 0.0, 0.25, 0.15, 0.0, 0.1])
    g = torch.Generator().manual_seed(11)
    n = 20_000
    counts = torch.bincount(torch.tensor([categorical(probs, g) for _ in range(n)]), minlength=6).double()
    assert counts[1] == 0 and counts[4] == 0
    live = probs > 0
    bound = chi2.ppf(1 - 1e-6, df=int(live.sum()) - 1)

    def statistic(c):
        expected = probs[live].double() * n
        return float(((c[live] - expected) ** 2 / expected).sum())
    assert statistic(counts) < bound
    uniform = torch.zeros(6, dtype=torch.float64)
    uniform[live] = n / int(live.sum())
    assert statistic(uniform) > bound
    # Any positive total works (the row need not be normalised).
    assert categorical(torch.tensor([0.0, 3.0]), g) == 1


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


# -- the extras, against transformers' logits processors ---------------------------------------

PROMPT, OUTPUTS = (3, 9, 9, 17, 4), [17, 22, 3]


def hf_processed(logits: torch.Tensor, processors: list, context: list[int]) -> torch.Tensor:
    """logits [V] through transformers' processors, for one sequence whose tokens so far are context."""
    return LogitsProcessorList(processors)(torch.tensor([context]), logits[None].clone())[0]


def test_logit_bias_is_added_to_the_raw_logits():
    logits = logits_rows(1, seed=11)[0]
    bias = ((4, 100.0), (7, -100.0), (12, 2.5), (30, -0.75))
    ours = process_logits(logits[None], [chunk("a", SamplingParams(logit_bias=bias))])[0]
    ref = hf_processed(logits, [SequenceBiasLogitsProcessor([[[t], b] for t, b in bias])], [1])
    assert_close(ours, ref, k=1, what="biased logits")
    assert_close(torch.softmax(ours, -1), torch.softmax(ref, -1), k=V, what="biased probabilities")
    # Greedy follows the bias; +100 all but forces a token, -100 all but bans one.
    out = Sampler(0)(logits[None], [chunk("a", SamplingParams(temperature=0, logit_bias=bias, logprobs=0))])[0]
    assert out.token_id == 4
    assert_close(out.logprob, torch.log_softmax(logits, -1)[4], k=V)    # logprobs stay the raw model's


def test_repetition_penalty_covers_prompt_and_output():
    logits = logits_rows(1, seed=12)[0]
    for penalty in (1.3, 0.7):
        ours = process_logits(logits[None], [chunk("a", SamplingParams(repetition_penalty=penalty), OUTPUTS,
                                                   PROMPT)])[0]
        ref = hf_processed(logits, [RepetitionPenaltyLogitsProcessor(penalty)], [*PROMPT, *OUTPUTS])
        assert_close(ours, ref, k=1, what=f"repetition penalty {penalty}")
        seen = sorted({*PROMPT, *OUTPUTS})
        unseen = [t for t in range(V) if t not in seen]
        assert torch.equal(ours[unseen], logits[unseen])


@pytest.mark.parametrize("top_k", [1, 5, 20, V - 1])
def test_top_k_matches_transformers(top_k):
    logits = logits_rows(1, seed=13)[0]
    ours = warp_logits(logits, SamplingParams(temperature=0.8, top_k=top_k))
    ref = hf_processed(logits, [TemperatureLogitsWarper(0.8), TopKLogitsWarper(top_k)], [1])
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref)) and int(torch.isfinite(ours).sum()) == top_k
    assert_close(torch.softmax(ours, -1), torch.softmax(ref, -1), k=V)


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_transformers(min_p):
    logits = logits_rows(1, seed=14)[0]
    ours = warp_logits(logits, SamplingParams(temperature=1.5, min_p=min_p))
    ref = hf_processed(logits, [TemperatureLogitsWarper(1.5), MinPLogitsWarper(min_p)], [1])
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    assert_close(torch.softmax(ours, -1), torch.softmax(ref, -1), k=V)
    if min_p == 1.0:
        assert int(torch.isfinite(ours).sum()) == 1


def test_the_whole_chain_in_a_mixed_batch_follows_vllm_order():
    """bias -> repetition -> temperature -> min_p -> top-k -> top-p, each row with its own parameters,
    equals transformers' processors chained in that order on that row alone."""
    logits = logits_rows(4, seed=15)
    params = [SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                             logit_bias=((5, 3.0), (8, -4.0))),
              SamplingParams(temperature=1.3),
              SamplingParams(temperature=1.0, min_p=0.2, logit_bias=((1, 1.5),)),
              SamplingParams(temperature=0.5, top_p=0.8, repetition_penalty=0.9)]
    chunks = [chunk(str(i), p, OUTPUTS, PROMPT) for i, p in enumerate(params)]
    processed = process_logits(logits, chunks)
    for i, p in enumerate(params):
        ours = warp_logits(processed[i], p)
        hf = [SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias])] if p.logit_bias else []
        hf += [RepetitionPenaltyLogitsProcessor(p.repetition_penalty), TemperatureLogitsWarper(p.temperature)]
        hf += [MinPLogitsWarper(p.min_p)] if p.min_p else []
        hf += [TopKLogitsWarper(p.top_k)] if p.top_k else []
        hf += [TopPLogitsWarper(p.top_p)] if p.top_p < 1 else []
        ref = hf_processed(logits[i], hf, [*PROMPT, *OUTPUTS])
        assert torch.equal(torch.isfinite(ours), torch.isfinite(ref)), i
        assert_close(torch.softmax(ours, -1), torch.softmax(ref, -1), k=V, what=f"row {i}")


def test_blocked_tokens_are_never_chosen_and_logprobs_stay_raw():
    logits = logits_rows(2, seed=16)
    best = int(logits[0].argmax())
    # Even +100 on a blocked id cannot bring it back (min_tokens beats logit_bias, as in vLLM).
    p = SamplingParams(temperature=0, logit_bias=((best, 100.0),), logprobs=1)
    out = Sampler(0)(logits, [chunk("a", p, blocked=(best, 2)), chunk("b", SamplingParams(temperature=0))])
    assert out[0].token_id not in (best, 2) and out[1].token_id == int(logits[1].argmax())
    assert out[0].top_logprobs[0][0] == best
    drawn = {Sampler(0)(logits[:1], [chunk("a", SamplingParams(temperature=50.0, seed=s), blocked=(best,))])[0]
             .token_id for s in range(200)}
    assert best not in drawn and len(drawn) > 10


def test_seeded_extras_are_independent_of_batch():
    target = logits_rows(1, seed=17)[0]
    params = SamplingParams(temperature=1.1, top_k=25, top_p=0.95, min_p=0.02, repetition_penalty=1.15, seed=77,
                            presence_penalty=0.3, frequency_penalty=0.2, logit_bias=((3, 2.0), (9, -1.0)))
    others = [SamplingParams(temperature=0.9, repetition_penalty=1.4, logit_bias=((3, -50.0),), min_p=0.3),
              SamplingParams(temperature=0, logit_bias=((9, 80.0),), seed=3),
              SamplingParams(temperature=2.0, top_k=3, presence_penalty=-1.0, seed=4)]
    outputs = []
    for step in range(12):
        rows = [logits_rows(1, seed=300 + step)[0], target, logits_rows(1, seed=400 + step)[0],
                logits_rows(1, seed=500 + step)[0]]
        chunks = [chunk("x", others[0], [5, 6], (1, 2)), chunk("t", params, outputs, PROMPT),
                  chunk("y", others[1], outputs[:2]), chunk("z", others[2], [3, 3], blocked=(3,))]
        in_batch = Sampler(step)(torch.stack(rows), chunks)[1].token_id
        alone = Sampler(999)(target[None], [chunk("t", params, outputs, PROMPT)])[0].token_id
        assert in_batch == alone, step
        outputs.append(in_batch)
    assert len(set(outputs)) > 1


def test_invalid_extras_are_refused():
    logits = logits_rows(1)
    with pytest.raises(InvalidArgument, match="min_p"):
        Sampler(0)(logits, [chunk("a", SamplingParams(min_p=1.5))])
    with pytest.raises(InvalidArgument, match="repetition_penalty"):
        Sampler(0)(logits, [chunk("a", SamplingParams(repetition_penalty=0.0))])


def test_greedy_runs_match_run_over_the_full_logits_with_drafts():
    """What the runner does with the screen's argmax equals Sampler.run on the logits themselves."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    logits = logits_rows(9, seed=11)
    best = logits.max(dim=1).indices.tolist()
    chunks = [ScheduledChunk("a", [1], 0, [0], True, greedy),                                   # no drafts: row 0
              replace(chunk("b", greedy), draft_token_ids=[best[1], best[2], (best[3] + 1) % V]),  # rows 1-4
              replace(chunk("c", greedy), draft_token_ids=[(best[5] + 1) % V, best[6]]),           # rows 5-7
              replace(chunk("d", greedy), draft_token_ids=[])]                                    # row 8
    want = Sampler(0).run(logits.clone(), chunks)
    got = Sampler.greedy_runs(best, chunks)
    assert [[t.token_id for t in r] for r in got] == [[t.token_id for t in r] for r in want]
    assert [len(r) for r in got] == [1, 3, 1, 1]
    with pytest.raises(ValueError, match="argmax rows"):
        Sampler.greedy_runs(best[:-1], chunks)


def test_plain_greedy_is_only_temperature_zero_without_anything_else():
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    assert Sampler.plain_greedy([chunk("a", greedy), chunk("b", greedy)])
    for other in (chunk("t", SamplingParams(temperature=0.5, max_tokens=8)),
                  chunk("l", SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)),
                  chunk("b", SamplingParams(temperature=0.0, max_tokens=8, logit_bias={3: 1.0})),
                  chunk("r", SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.2)),
                  chunk("s", greedy, blocked=(2,)),
                  replace(chunk("g", greedy), grammar=object())):
        assert not Sampler.plain_greedy([chunk("a", greedy), other]), other.request_id
