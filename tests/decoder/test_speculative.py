"""Speculative decoding through the real engine (core + runner) against transformers' greedy
generate: token for token on the tiny Llama, Qwen2 and Qwen3, with prefill and drafts cut by a
small token budget, with preemption, with n=2, and with the emitted tokens' logprobs."""
from __future__ import annotations

import pytest
import torch

from services.decoder.engine.config import EngineConfig, SpeculativeConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.step import SamplingParams
from services.decoder.runner.runner import Runner
from tests.decoder.drive import drive
from tests.decoder.model.checkpoints import TINY_SHAPE, build, greedy_reference, load_reference
from tests.tolerance import assert_close

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1,
                         disable_by_batch_size=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
# Prompts built to repeat, so that drafts come from the prompt as well as from the output's loops.
PROMPTS = [[5, 9, 14, 3, 77, 21, 8] * 3, [40, 41] * 6, list(range(10, 33)), [7] * 13,
           [99, 3, 150, 12, 64, 99, 3, 150]]


@pytest.fixture(scope="module", params=["llama_gqa4_tied_sharded", "qwen2_gqa2_odd_tied", "qwen3_odd3_gqa3_qknorm"])
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp("spec"), request.param)


@pytest.fixture(scope="module")
def expected(checkpoint):
    return greedy_reference(checkpoint, PROMPTS, GREEDY.max_tokens)


def run_engine(folder, speculative, *, budget=512, num_blocks=256, prefix_caching=True, sampling=GREEDY,
               fast_paths="screen=on"):
    """Every prompt, one arrival per step; -> ({(prompt, choice): tokens}, {...: logprobs}, stats)."""
    runner = Runner.from_folder(folder, "fp32", 4, num_blocks, fast_paths=fast_paths)
    core = EngineCore(runner, EngineConfig(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget,
                                           max_num_seqs=8, max_model_len=64, enable_prefix_caching=prefix_caching,
                                           speculative=speculative))
    emitted = drive(core, PROMPTS, sampling)
    tokens = {key: [t.token_id for t in run] for key, run in emitted.items()}
    logprobs = {key: [t.logprob for t in run] for key, run in emitted.items()}
    return tokens, logprobs, core.stats()


@pytest.mark.numerics            # the logprobs comparison: run again under the second kernel dispatch (Makefile)
@pytest.mark.parametrize("budget", [512, 5])
def test_greedy_with_speculation_equals_transformers(checkpoint, expected, budget):
    tokens, logprobs, stats = run_engine(checkpoint, SPEC, budget=budget)
    assert [tokens[(i, 0)] for i in range(len(PROMPTS))] == expected
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    # The logprobs are those of the emitted tokens, as without speculation (up to the order of work).
    _, plain, _ = run_engine(checkpoint, None, budget=budget)
    for key, values in plain.items():
        assert_close(logprobs[key], values, **TINY_SHAPE)


@pytest.mark.parametrize("pin", ["adaptive", "always"])
def test_the_draft_gate_pinned_either_way_keeps_greedy_outputs(checkpoint, expected, pin):
    """adaptive: drafting gated per request on the verify costs measured at load; always: every n-gram hit
    drafted. Which drafts are verified changes, the tokens do not."""
    tokens, _, stats = run_engine(checkpoint, SPEC, fast_paths=f"screen=on,speculation={pin}")
    assert [tokens[(i, 0)] for i in range(len(PROMPTS))] == expected
    assert stats.num_accepted_tokens > 0


def test_verify_costs_are_measured_at_load_unless_pinned_always(checkpoint):
    runner = Runner.from_folder(checkpoint, "fp32", 4, 64, fast_paths="speculation=adaptive")
    seconds = runner.verify_seconds(SPEC.num_speculative_tokens)
    assert len(seconds) == SPEC.num_speculative_tokens + 1 and min(seconds) > 0
    choice = runner.plan.get("speculation")
    assert choice.chosen == "adaptive" and [t.rows for t in choice.timings] == [1, 2, 3, 4, 5]
    core = EngineCore(runner, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8,
                                           max_model_len=64, speculative=SPEC))
    assert core.scheduler.gate is not None
    pinned = Runner.from_folder(checkpoint, "fp32", 4, 64, fast_paths="speculation=always")
    core = EngineCore(pinned, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8,
                                           max_model_len=64, speculative=SPEC))
    assert core.scheduler.gate is None and pinned.plan.chosen("speculation") == "always"


def test_speculation_under_preemption_equals_transformers(checkpoint, expected):
    tokens, _, stats = run_engine(checkpoint, SPEC, num_blocks=14, budget=16, prefix_caching=False)
    assert stats.num_preemptions > 0 and stats.num_accepted_tokens > 0
    assert [tokens[(i, 0)] for i in range(len(PROMPTS))] == expected


def test_two_choices_each_verify_their_own_drafts(checkpoint, expected):
    tokens, _, stats = run_engine(checkpoint, SPEC, sampling=SamplingParams(
        temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True, n=2))
    assert stats.num_accepted_tokens > 0
    for i in range(len(PROMPTS)):
        assert tokens[(i, 0)] == tokens[(i, 1)] == expected[i]


def test_mixed_adapter_batch_with_speculation_equals_peft(tmp_path):
    """Two adapters and base rows in one batch: each row's drafts are verified with its own adapter."""
    from services.decoder.lora import adapter_request
    from tests.decoder.lora.adapters import SPECS, lora_engine, peft_mixed, register, write_adapter

    base = build(tmp_path, "qwen2_gqa2_odd_tied")
    folders = {s.name: write_adapter(base, tmp_path / "adapters", s) for s in SPECS[:2]}
    peft = peft_mixed(base, folders)
    workload = [(0, "alpha"), (1, None), (3, "beta"), (0, None), (4, "alpha"), (3, "beta")]
    expected = []
    with torch.no_grad():
        for p, a in workload:
            ids = torch.tensor([PROMPTS[p]])
            gen = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0, adapter_names=[a or "__base__"])
            expected.append(gen[0, ids.shape[1]:].tolist())
    core, registry = lora_engine(base, budget=24, speculative=SPEC)
    digests = {n: register(registry, n, f).digest for n, f in folders.items()}
    got = {str(i): [] for i in range(len(workload))}
    for i, (p, a) in enumerate(workload):
        adapter, keys = adapter_request(a, digests[a]) if a else (None, ())
        core.add_request(str(i), PROMPTS[p], GREEDY, extra_keys=keys, adapter=adapter)
    while core.has_unfinished():
        for out in core.step():
            assert out.finish_reason in (None, "length"), out
            got[out.request_id].extend(out.new_token_ids)
    assert [got[str(i)] for i in range(len(workload))] == expected
    assert expected[0] != expected[3]                      # the adapter changes the tokens
    stats = core.stats()
    assert stats.num_accepted_tokens > 0, stats
    core.check_idle()
    assert registry.total_refs == 0


# -- the distribution at temperature 1 --------------------------------------------------------------

SMALL_VOCAB = 12
# Every token of the vocabulary occurs in the prompt, so whatever is sampled, a 1-gram repeats and
# the drafter proposes: every request's second and third tokens go through verification.
DIST_PROMPT = [4, 7, 1, 9, 3, 11, 0, 5, 8, 2, 10, 6, 4, 9]
DIST_SAMPLES = 2000


def _sample_first_three(folder, speculative, wrong_rule=False):
    """DIST_SAMPLES seeded requests at temperature 1 -> tokens [N, 3], engine stats."""
    runner = Runner.from_folder(folder, "fp32", 4, 1024, fast_paths="screen=on")
    if wrong_rule:
        # A deliberately wrong verifier that always accepts every draft (and adds the bonus token).
        real = runner.sampler.run

        def always_accept(logits, chunks):
            from services.decoder.engine.step import SampledToken
            return [[SampledToken(d, 0.0) for d in c.draft_token_ids] + [run[-1]]
                    for c, run in zip(chunks, real(logits, chunks), strict=True)]
        runner.sampler.run = always_accept
    core = EngineCore(runner, EngineConfig(block_size=4, num_blocks=1024, max_num_batched_tokens=4096,
                                           max_num_seqs=512, max_model_len=64, speculative=speculative))
    out = {}
    for s in range(DIST_SAMPLES):
        core.add_request(str(s), DIST_PROMPT, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=s))
    while core.has_unfinished():
        for o in core.step():
            out.setdefault(int(o.request_id), []).extend(o.new_token_ids)
    core.check_idle()
    return torch.tensor([out[s] for s in range(DIST_SAMPLES)]), core.stats()


def _exact_marginals(folder) -> torch.Tensor:
    """[3, V]: the exact distribution of the 1st, 2nd and 3rd sampled token, summed over every
    prefix with transformers' logits (V + V^2 contexts)."""
    model = load_reference(folder)
    V = SMALL_VOCAB
    with torch.no_grad():
        def probs(ctx):                       # ctx [B, T] -> next-token probabilities [B, V]
            return torch.softmax(model(input_ids=ctx).logits[:, -1].double(), -1)
        prompt = torch.tensor([DIST_PROMPT])
        p1 = probs(prompt)[0]                                                           # [V]
        ctx2 = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], 1)
        p2 = probs(ctx2)                                                                # [V(t1), V(t2)]
        ctx3 = torch.cat([ctx2.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
        p3 = probs(ctx3).view(V, V, V)                                                  # [t1, t2, t3]
    joint12 = p1[:, None] * p2
    return torch.stack([p1, joint12.sum(0), (joint12[..., None] * p3).sum((0, 1))])


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of one position's counts against its exact probabilities, cells with an
    expected count under 5 pooled into one (the chi-square approximation needs it)."""
    expected = probs * len(tokens)
    observed = torch.bincount(tokens, minlength=len(probs)).double()
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    return float(((observed - expected) ** 2 / expected).sum()), len(expected) - 1


def test_sampling_with_speculation_keeps_the_target_distribution(tmp_path):
    from scipy.stats import chi2

    folder = build(tmp_path, "llama_mha_untied", seed=3, vocab_size=SMALL_VOCAB)
    exact = _exact_marginals(folder)
    # A bound that a correct sampler exceeds once in 10^4 runs at each position; the seeds are
    # fixed, so the test is deterministic.
    def fits(tokens):
        return [(lambda stat_df: stat_df[0] < chi2.ppf(1 - 1e-4, stat_df[1]))(_chi_square(tokens[:, j], exact[j]))
                for j in range(3)]

    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1,
                             disable_by_batch_size=10**6)
    plain, _ = _sample_first_three(folder, None)
    assert fits(plain) == [True, True, True]
    tokens, stats = _sample_first_three(folder, spec)
    assert fits(tokens) == [True, True, True]
    # Every request verified drafts, and some were rejected: the rule was really exercised.
    assert stats.num_verifications >= DIST_SAMPLES and 0.02 < stats.acceptance_rate < 0.98, stats
    # The coupled form draws each position's token with the same per-token seed as without drafts:
    # seeded outputs stay the same (up to a logit rounding that moves a draw across a CDF step).
    assert (tokens == plain).all(1).double().mean() > 0.99
    # The test can fail: a verifier that always accepts gives the 2nd and 3rd tokens another law.
    wrong, _ = _sample_first_three(folder, spec, wrong_rule=True)
    assert fits(wrong)[0] and not any(fits(wrong)[1:])
