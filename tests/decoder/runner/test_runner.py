"""The Runner over the paged cache vs transformers: chunked prefill, decode, mixed batches."""
from __future__ import annotations

import random

import pytest
import torch

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.engine.step import PlacedImages, SamplingParams, StepInput
from services.decoder.kernels import gemv_cpu
from services.decoder.runner import Runner
from tests.decoder.model.checkpoints import TINY_SHAPE, build, load_reference
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

BLOCK = 4
CASES = ["llama_gqa4_tied_sharded", "qwen2_gqa2_odd_tied", "qwen3_odd3_gqa3_qknorm"]
# The parity tests run each fast path pinned on and pinned off (services/common/plan.py), whatever the
# load-time timing would pick on this machine. The decode stack needs the matmul path timed, so the
# packed/plain split is pinned on its own (tests/common/test_linear_path.py compares the two directly).
PLANS = {
    "fast": "gemv=on,glue=cpp,attention=cpp,decode_stack=on,screen=on,grammar_mask=xgrammar",
    "reference": "linear=plain,gemv=off,glue=torch,attention=torch,decode_stack=off,screen=off,"
                 "grammar_mask=unpacked,huge_pages=off",
    "packed": "linear=packed,gemv=off,attention=cpp",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build(root, name, seed=10 + i) for i, name in enumerate(CASES)}


@pytest.fixture(scope="module")
def references(folders):
    return {name: load_reference(folder) for name, folder in folders.items()}


def prompt(n: int, seed: int) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(4, 160) for _ in range(n)]


def hf_last_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", CASES)
def test_chunked_prefill_then_decode_matches_transformers(folders, references, name, plan):
    runner = Runner.from_folder(folders[name], "fp32", block_size=BLOCK, num_blocks=64, fast_paths=PLANS[plan])
    ref = references[name]
    alloc = BlockAllocator(64)
    seq = Seq("a", prompt(23, 1))
    for size in (5, 1, 9, 8):                  # uneven, and one 1-token chunk mid-prompt
        out = runner.execute(StepInput([seq.chunk(size, alloc, BLOCK)]))
        assert out.sampled == {} or seq.computed == 23
    produced = [out.sampled["a"].token_id]
    seq.tokens.append(produced[-1])
    for _ in range(7):
        chunk = seq.chunk(1, alloc, BLOCK)
        logits, _ = runner.logits(StepInput([chunk]))
        assert_close(logits[0], hf_last_logits(ref, seq.tokens), **TINY_SHAPE)
        produced.append(int(logits[0].argmax()))
        seq.tokens.append(produced[-1])
    with torch.no_grad():
        expected = ref.generate(torch.tensor([seq.tokens[:23]]), do_sample=False, max_new_tokens=8,
                                pad_token_id=0)[0, 23:].tolist()
    assert produced[:len(expected)] == expected and len(expected) >= 1


def run_alone(runner: Runner, alloc: BlockAllocator, seq: Seq, steps: int) -> list[torch.Tensor]:
    """Whole prompt in one chunk, then greedy decode: the per-step sampled logits."""
    out = []
    for _ in range(steps):
        chunk = seq.chunk(len(seq.tokens), alloc, BLOCK)
        logits, _ = runner.logits(StepInput([chunk]))
        out.append(logits[0])
        seq.tokens.append(int(logits[0].argmax()))
    return out


@pytest.mark.parametrize("plan", ["fast", "reference"])
def test_mixed_batch_equals_one_by_one(folders, plan):
    """Staggered arrivals, random chunk sizes: every step mixes prefill and decode rows."""
    name = "qwen2_gqa2_odd_tied"
    runner = Runner.from_folder(folders[name], "fp32", block_size=BLOCK, num_blocks=200, fast_paths=PLANS[plan])
    alloc = BlockAllocator(200, seed=3)
    lengths, steps = [3, 11, 17, 30, 1], 5
    alone = {i: run_alone(runner, alloc, Seq(str(i), prompt(n, i)), steps) for i, n in enumerate(lengths)}
    rng = random.Random(7)
    waiting = [Seq(str(i), prompt(n, i)) for i, n in enumerate(lengths)]
    running, got = [], {str(i): [] for i in range(len(lengths))}
    mixed_steps = 0
    while waiting or running:
        if waiting:
            running.append(waiting.pop(0))         # one arrival per step
        chunks = [s.chunk(rng.randint(1, 7), alloc, BLOCK) for s in running]
        mixed_steps += len({len(c.token_ids) > 1 for c in chunks}) == 2
        logits, batch = runner.logits(StepInput(chunks))
        for row, c in enumerate(batch.sampled):
            seq = next(s for s in running if s.rid == c.request_id)
            got[c.request_id].append(logits[row])
            seq.tokens.append(int(logits[row].argmax()))
        running = [s for s in running if len(got[s.rid]) < steps]
    assert mixed_steps >= 3
    for i in range(len(lengths)):
        for a, b in zip(got[str(i)], alone[i], strict=True):
            assert_close(a, b, **TINY_SHAPE, what=f"request {i}")
            assert int(a.argmax()) == int(b.argmax())


def test_execute_samples_only_finished_chunks(folders):
    runner = Runner.from_folder(folders["llama_gqa4_tied_sharded"], block_size=BLOCK, num_blocks=32)
    alloc = BlockAllocator(32)
    a, b = Seq("a", prompt(10, 1)), Seq("b", prompt(3, 2))
    out = runner.execute(StepInput([a.chunk(4, alloc, BLOCK), b.chunk(3, alloc, BLOCK)]))
    assert set(out.sampled) == {"b"}
    assert runner.eos_token_ids == (2, 3) and runner.vocab_size == 160 and runner.max_position_embeddings == 256


def test_bad_steps_are_refused(folders):
    runner = Runner.from_folder(folders["llama_gqa4_tied_sharded"], block_size=BLOCK, num_blocks=32)
    alloc = BlockAllocator(32)
    placed = PlacedImages(torch.zeros(3, 2, dtype=torch.long), 0)

    def bad():       # fresh each time: a Seq marks what it handed out as computed
        return [Seq("a", [5, 999]), Seq("l", [5, 6], lora_slot=0), Seq("i", [5, 6], images=placed),
                Seq("s", [5, 6], sampling=SamplingParams(temperature=-1.0))]
    # Run directly (logits), each is refused with its typed error...
    for seq, error, match in zip(bad(), (InvalidArgument, Unsupported, Unsupported, InvalidArgument),
                                 ("token ids", "LoRA adapters need an adapter bank", "M-RoPE", "temperature"),
                                 strict=True):
        with pytest.raises(error, match=match):
            runner.logits(StepInput([seq.chunk(2, alloc, BLOCK)]))
    # ...and in an engine step each fails alone: the step's good chunk is computed and sampled as if
    # it ran by itself.
    chunks = [c.chunk(2, alloc, BLOCK) for c in bad()]
    chunks.insert(2, Seq("g", [5, 6, 7]).chunk(3, alloc, BLOCK))
    out = runner.execute(StepInput(chunks))
    assert set(out.failed) == {"a", "l", "i", "s"} and set(out.sampled) == {"g"}
    assert "token ids" in out.failed["a"] and "adapter bank" in out.failed["l"] and "M-RoPE" in out.failed["i"]
    assert "temperature" in out.failed["s"]
    alone = runner.execute(StepInput([Seq("g", [5, 6, 7]).chunk(3, BlockAllocator(32, seed=1), BLOCK)]))
    assert out.sampled["g"].token_id == alone.sampled["g"].token_id
    # A step of refused chunks only runs nothing.
    assert runner.execute(StepInput([Seq("b", [999]).chunk(1, alloc, BLOCK)])).failed.keys() == {"b"}


@pytest.mark.parametrize("plan", list(PLANS))
def test_bf16_runner_tracks_fp32(folders, references, plan):
    """bf16 weights, KV cache and packed matmuls: close to the fp32 reference, same first token."""
    name = "llama_gqa4_tied_sharded"
    runner = Runner.from_folder(folders[name], "bf16", block_size=BLOCK, num_blocks=32,
                                fast_paths=PLANS[plan].replace("screen=on", "screen=auto"))
    assert any(c.name.startswith("linear ") for c in runner.plan.choices) and runner.cache.k[0].dtype == torch.bfloat16
    alloc, seq = BlockAllocator(32), Seq("a", prompt(13, 4))
    runner.logits(StepInput([seq.chunk(6, alloc, BLOCK)]))
    logits, _ = runner.logits(StepInput([seq.chunk(7, alloc, BLOCK)]))
    expected = hf_last_logits(references[name], seq.tokens)
    assert_close(logits[0], expected, dtype=torch.bfloat16, **TINY_SHAPE)
    assert int(logits[0].argmax()) == int(expected.argmax())


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_weights_and_cache_live_in_arenas(folders, quantization):
    """Every weight a step reads is a view of the model's arena (a tied LM head still the embedding
    table), every KV tensor of the cache's; the logits stay transformers' (the tests above)."""
    runner = Runner.from_folder(folders["llama_gqa4_tied_sharded"], "fp32", block_size=BLOCK, num_blocks=16,
                                quantization=quantization)
    model, held = runner.model, runner.model.arena

    def inside(t: torch.Tensor, a) -> bool:
        return a.address <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= a.address + a.size

    weights = [p for p in model.parameters() if p.numel()]
    weights += [t for m in model.modules() for t in (getattr(m, "qweight", None), getattr(m, "qscale", None))
                if t is not None]
    assert (quantization == "int8") == any(t.dtype == torch.int8 for t in weights)
    assert weights and all(inside(t, held) for t in weights)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(inside(t, runner.cache.arena) for t in runner.cache.k + runner.cache.v)
    pages = runner.plan.get("huge_pages")
    assert pages.chosen == "on" and pages.reason.startswith("weights: one arena of ")
    assert "; KV cache: one arena of " in pages.reason


def test_huge_pages_pinned_off_leave_torch_allocations(folders):
    runner = Runner.from_folder(folders["llama_gqa4_tied_sharded"], "fp32", block_size=BLOCK, num_blocks=16,
                                fast_paths="huge_pages=off")
    assert runner.model.arena is None and runner.cache.arena is None
    assert runner.plan.chosen("huge_pages") == "off" and "huge pages off" in runner.plan.get("huge_pages").reason


def test_every_choice_is_in_the_plan(folders):
    """A runner reports each fast path it chose, pinned ones with the pin as their reason."""
    runner = Runner.from_folder(folders["llama_gqa4_tied_sharded"], "fp32", block_size=BLOCK, num_blocks=64,
                                fast_paths=PLANS["reference"])
    names = [c.name for c in runner.plan.choices]
    for name in ("gemv", "glue.norm", "glue.act", "huge_pages", "attention", "decode_stack", "screen",
                 "grammar_mask"):
        assert name in names and runner.plan.get(name).reason
    assert any(n.startswith("linear ") for n in names)
    assert runner.plan.chosen("attention") == "torch" and runner.attention_backend == "torch-gather"

@pytest.mark.parametrize("scores", ["kernel", "panels"])
def test_greedy_steps_through_the_argmax_screen_equal_the_full_head(tmp_path, scores):
    """The same mixed steps on a runner with the screen pinned on (scoring by either scorer) and one with it
    pinned off: the same tokens; a step with a row that wants logprobs takes the full head. A vocabulary of
    whole 64-column panels, so that the panel kernel scores where the CPU has it."""
    from services.decoder.engine.step import SamplingParams
    folder = build(tmp_path, "qwen2_gqa2_odd_tied", seed=11, vocab_size=192)
    screened = Runner.from_folder(folder, "fp32", block_size=BLOCK, num_blocks=200,
                                  fast_paths=f"screen=on,screen_scores={scores}")
    full = Runner.from_folder(folder, "fp32", block_size=BLOCK, num_blocks=200, fast_paths="screen=off")
    assert screened.screen is not None and full.screen is None
    # A CPU without the panels (no bf16 dot product) scores by the kernel whatever the pin, and says so.
    expect = scores if screened.screen.panels is not None else "kernel"
    assert screened.plan.chosen("screen_scores") == expect
    assert screened.screen.kernel_rows == (0 if expect == "panels" else gemv_cpu.MAX_ROWS)
    assert full.plan.get("screen").reason == "pinned by --fast-paths screen=off" and full.plan.chosen("screen") == "off"
    calls = []
    real_argmax = screened.screen.argmax
    screened.screen.argmax = lambda h: calls.append(h.shape[0]) or real_argmax(h)
    tokens = {}
    for runner in (screened, full):
        alloc = BlockAllocator(200, seed=3)
        seqs = [Seq(str(i), prompt(n, i)) for i, n in enumerate([3, 11, 17, 1])]
        got = {s.rid: [] for s in seqs}
        for _ in range(8):
            out = runner.execute(StepInput([s.chunk(5, alloc, BLOCK) for s in seqs]))
            for s in seqs:
                if s.rid in out.sampled:
                    s.tokens.append(out.sampled[s.rid].token_id)
                    got[s.rid].append(out.sampled[s.rid].token_id)
        tokens[runner is screened] = got
    assert tokens[True] == tokens[False] and all(len(t) >= 5 for t in tokens[True].values())
    assert calls and max(calls) == 4
    calls.clear()
    alloc = BlockAllocator(200)
    wants = Seq("p", prompt(6, 9), sampling=SamplingParams(temperature=0.0, max_tokens=4, logprobs=2))
    out = screened.execute(StepInput([wants.chunk(6, alloc, BLOCK), Seq("q", prompt(4, 8)).chunk(4, alloc, BLOCK)]))
    assert calls == [] and out.sampled["p"].logprob is not None
