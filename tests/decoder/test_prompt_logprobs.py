"""Prompt logprobs (SamplingParams.prompt_logprobs) through the real engine (core + runner) against transformers'
log_softmax over the same ids: with the prompt cut into chunks by a small token budget, with max_tokens 0 (the
prompt alone), after another request left the same prefix in the prefix cache (the scored request reads no hits,
later ones still do), and through preemption."""
from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgument
from services.decoder.engine.config import EngineConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.output import RequestOutput
from services.decoder.engine.step import SamplingParams
from services.decoder.runner.runner import Runner
from tests.decoder.model.checkpoints import TINY_SHAPE, build, greedy_reference, load_reference
from tests.tolerance import assert_close

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

PROMPT = [5, 9, 14, 3, 77, 21, 8, 40, 41, 40, 41, 10, 11, 12, 150, 12, 64, 99, 3]     # 19 tokens, 4-token blocks
TOP = 3
# Every fast path pinned one way: the fused decode stack runs one-row chunks, or the layers do.
PATHS = {"on": "attention=cpp,decode_stack=on,screen=on", "off": "attention=torch,decode_stack=off,screen=off"}


@pytest.fixture(scope="module", params=["qwen2_gqa2_odd_tied", "gemma2_gqa2_window_softcap"])
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp("scores"), request.param)


def log_softmax(folder) -> torch.Tensor:
    """transformers' log_softmax [T, vocab] over PROMPT: row p scores token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(load_reference(folder)(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return log_softmax(checkpoint)


def engine(folder, *, budget: int, num_blocks: int = 64, prefix_caching: bool = True,
           fast_paths: str | None = None) -> EngineCore:
    runner = Runner.from_folder(folder, "fp32", 4, num_blocks, fast_paths=fast_paths)
    return EngineCore(runner, EngineConfig(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget,
                                           max_num_seqs=4, max_model_len=64, enable_prefix_caching=prefix_caching,
                                           vocab_size=runner.vocab_size))


def run(core: EngineCore, requests: dict[str, SamplingParams], stagger: bool = False) -> dict[str, list[RequestOutput]]:
    """Add every request (one per step with stagger), step to the end -> request id -> its outputs in order."""
    outputs: dict[str, list[RequestOutput]] = {}
    pending = list(requests.items())
    if not stagger:
        for rid, sampling in pending:
            core.add_request(rid, PROMPT, sampling)
        pending = []
    for _ in range(500):
        if pending:
            rid, sampling = pending.pop(0)
            core.add_request(rid, PROMPT, sampling)
        for out in core.step():
            assert out.finish_reason in (None, "length"), out
            outputs.setdefault(out.request_id, []).append(out)
        if not pending and not core.has_unfinished():
            core.check_idle()
            return outputs
    raise AssertionError("the engine did not finish")


def check_scores(first: RequestOutput, reference: torch.Tensor) -> None:
    """The first output's prompt logprobs equal the reference's: values, ranks and the top alternatives."""
    scores = first.prompt_logprobs
    assert first.first and scores is not None and len(scores) == len(PROMPT) and scores[0] is None
    assert [e.token_id for e in scores[1:]] == PROMPT[1:]
    expected = reference[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    assert_close(torch.tensor([e.logprob for e in scores[1:]]), expected, **TINY_SHAPE)
    tol = 1e-3
    for p, e in enumerate(scores[1:]):
        row = reference[p]
        # The rank counts the tokens above this one; near-ties may fall either way.
        assert int((row > expected[p] + tol).sum()) + 1 <= e.rank <= int((row > expected[p] - tol).sum()) + 1
        assert len(e.top) == TOP
        assert_close(torch.tensor([v for _, v in e.top]), row.topk(TOP).values, **TINY_SHAPE)


@pytest.mark.parametrize("budget", [512, 5])
def test_prompt_alone_equals_transformers(checkpoint, reference, budget):
    """max_tokens 0: the prompt is computed in chunks of <= budget tokens, scored, and nothing is generated."""
    outs = run(engine(checkpoint, budget=budget), {"a": SamplingParams(max_tokens=0, prompt_logprobs=TOP)})["a"]
    assert len(outs) == 1 and outs[0].finish_reason == "length" and not outs[0].new_tokens
    assert outs[0].num_prompt_tokens == len(PROMPT) and outs[0].num_completion_tokens == 0
    check_scores(outs[0], reference)


@pytest.mark.parametrize("stack", ["on", "off"])
def test_one_token_chunks_through_either_decode_path(tmp_path, stack):
    """A budget of 1 makes every prompt chunk one row, which the fused decode stack runs when pinned on (a model
    it takes: Qwen2) and the layers when pinned off: either's hidden states score the prompt."""
    folder = build(tmp_path, "qwen2_gqa2_odd_tied")
    core = engine(folder, budget=1, fast_paths=PATHS[stack])
    outs = run(core, {"a": SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP)})["a"]
    check_scores(outs[0], log_softmax(folder))


def test_scores_come_first_then_generation_as_usual(checkpoint, reference):
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = run(engine(checkpoint, budget=5), {"a": SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                                  prompt_logprobs=TOP, logprobs=0)})["a"]
    check_scores(outs[0], reference)
    assert outs[0].new_tokens and not any(o.first or o.prompt_logprobs for o in outs[1:])
    assert [t.token_id for o in outs for t in o.new_tokens] == greedy_reference(checkpoint, [PROMPT], 5)[0]
    # Unaffected by scoring: the same tokens as a plain request.
    plain = run(engine(checkpoint, budget=5), {"b": greedy})["b"]
    assert [t.token_id for o in plain for t in o.new_tokens] == [t.token_id for o in outs for t in o.new_tokens]
    assert plain[0].first and plain[0].prompt_logprobs is None


def test_after_a_cached_prefix_still_right(checkpoint, reference):
    """A plain request caches the prompt's blocks; a scored one after it reads none (its counts say so) and is
    still right; a plain one after both hits the cache."""
    core = engine(checkpoint, budget=5)
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = run(core, {"warm": plain, "scored": SamplingParams(max_tokens=0, prompt_logprobs=TOP), "after": plain},
               stagger=True)
    assert outs["warm"][0].num_cached_tokens == 0
    assert outs["scored"][0].num_cached_tokens == 0
    check_scores(outs["scored"][0], reference)
    assert outs["after"][0].num_cached_tokens == 16
    # The scored request's prompt_logprobs do not bias its sampling: the same tokens as the warm request.
    assert [t.token_id for o in outs["after"] for t in o.new_tokens] == \
        [t.token_id for o in outs["warm"] for t in o.new_tokens]


def test_preempted_while_scoring_still_right(checkpoint, reference):
    """Two scored requests in a pool too small for both: the later one is preempted and recomputed; each scores
    every prompt token once."""
    core = engine(checkpoint, budget=5, num_blocks=8, prefix_caching=False)
    scored = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=TOP)
    outs = run(core, {"a": scored, "b": scored})
    assert core.stats().num_preemptions > 0
    for rid in ("a", "b"):
        check_scores(outs[rid][0], reference)


def test_refusals(checkpoint):
    core = engine(checkpoint, budget=5)
    with pytest.raises(InvalidArgument, match="at least 1") as exc:
        core.add_request("x", PROMPT, SamplingParams(max_tokens=0))
    assert exc.value.param == "max_tokens"
    with pytest.raises(InvalidArgument) as exc:
        core.add_request("y", PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=-1))
    assert exc.value.param == "prompt_logprobs"
    core.check_idle()
