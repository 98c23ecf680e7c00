"""Few-row decode steps through the C++ decode stack (runner/fused_decode.py) vs the model's own layers."""
from __future__ import annotations

import random

import pytest
import torch

from services.common.plan import ExecutionPlan
from services.decoder.engine.step import StepInput
from services.decoder.kernels import decode_stack_cpu, gemv_grouped_cpu, tile_gemm_cpu, widen_gemm_cpu
from services.decoder.model.linear import Linear
from services.decoder.runner import Runner, attention, fused_decode
from services.decoder.runner.batch import StepBatch
from services.decoder.runner.fused_decode import FusedDecode
from tests.decoder.model.checkpoints import TINY_SHAPE, build
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics

BLOCK, BLOCKS = 4, 320
CASES = ["llama_gqa4_tied_sharded", "qwen2_gqa2_odd_tied", "qwen3_odd3_gqa3_qknorm"]
VARIANTS = {"fp32": ("fp32", "none"), "bf16": ("bf16", "none"), "int8": ("fp32", "int8"), "int4": ("fp32", "int4"),
            "int8_tiles": ("fp32", "int8"), "int4_tiles": ("fp32", "int4"), "int8_amx": ("fp32", "int8"),
            "int4_amx": ("bf16", "int4")}
# Each quantized variant's many-row matmul, pinned so that both runners of a comparison run the same one.
MANY_ROWS = {"int8": "int8_gemm=int8pack", "int4": "grouped_matmul=dequant", "int8_tiles": "int8_gemm=tiles",
             "int4_tiles": "grouped_matmul=tiles", "int8_amx": "int8_gemm=amx", "int4_amx": "grouped_matmul=amx"}
QUANTIZED = tuple(MANY_ROWS)
FEW = ("int8", "int4")     # their weights run in the stack's few-row kernels only; the tiles ones above them too


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build(root, name, seed=30 + i) for i, name in enumerate(CASES)}


# The stack needs the in-place attention operator; at tiny shapes the load-time timing may pick the
# torch path, so these runners pin the operator.
PINS = "attention=cpp"


def stack_wins(path: str, rows: int, fn) -> float:
    fn()                          # every path still runs once: the timing steps must work
    return {"tiles": 0.5, "stack": 1.0, "layers": 2.0}[path]      # the panels, where they run


def runners(folder, variant: str) -> tuple[Runner, Runner]:
    dtype, quantization = VARIANTS[variant]
    if variant.endswith("_tiles") and not widen_gemm_cpu.available(torch.float32):
        pytest.skip("no widen_gemm_cpu kernel on this CPU (test_widen_gemm_cpu checks where)")
    if variant.endswith("_amx") and not widen_gemm_cpu.amx():
        pytest.skip("no tile unit on this CPU (test_widen_gemm_cpu checks where)")
    pins = ",".join(filter(None, (PINS, MANY_ROWS.get(variant))))
    fused = Runner.from_folder(folder, dtype, block_size=BLOCK, num_blocks=BLOCKS, quantization=quantization,
                               fast_paths=pins)
    layers = Runner.from_folder(folder, dtype, block_size=BLOCK, num_blocks=BLOCKS, quantization=quantization,
                                fast_paths=pins)
    layers.fused_decode = None
    # Both runners take the same elementwise glue and, quantized, the same few-row path (and the pinned many-row
    # matmul). Each is chosen by timing at load, and the quantized matmuls round activations differently: two
    # runners that chose differently under a parallel load compared two roundings (a C++ against a torch
    # RMSNorm in front of that rounding failed this test every time), not the stack against the layers.
    for runner in (fused, layers):
        runner.model.use_native_glue(norm=True, act=True)
        if variant in QUANTIZED:
            for m in runner.model.modules():
                if isinstance(m, Linear) and (m.qweight is not None or m.grouped is not None):
                    m.gemv_rows = decode_stack_cpu.KERNEL_ROWS
                    m.grouped_loop = gemv_grouped_cpu.WIDEST[-1]    # timed at load too; both loops are tested
    fused.fused_decode, fused.decode_stack = FusedDecode.build(fused.model, fused.cache, fused.attention_backend,
                                                               ExecutionPlan(), timer=stack_wins)
    return fused, layers


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_steps_match_the_layers(folders, name, variant):
    fused, layers = runners(folders[name], variant)
    widest = decode_stack_cpu.KERNEL_ROWS if variant in FEW else 64
    assert fused.decode_stack.startswith(f"cpp rows<={widest}; timed 1 row 1000.0 vs 2000.0 ms")
    # Steps of 2 rows and more run the panels (the timer has them win at every count from 2) wherever the CPU runs
    # them for the dtype and a projection fits (every case has one: a 64-wide hidden or a 192-wide gate_up), so the
    # comparison below covers them; int8 and grouped weights never take them (above their few-row kernel's rows, the
    # tiles variants run widen_gemm instead).
    dtype = fused.cache.k[0].dtype
    dense = [m.weight for layer in fused.model.model.layers
             for m in (layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down_proj)
             if m.qweight is None and m.grouped is None]
    # (bf16 on a CPU with AMX: the tile unit's panels, which take any bf16 weight)
    amx = dtype == torch.bfloat16 and widen_gemm_cpu.amx() and bool(dense)
    tiles = variant not in FEW and (amx or tile_gemm_cpu.available(dtype) and any(map(tile_gemm_cpu.fits, dense)))
    assert fused.fused_decode.tiles == tiles and fused.fused_decode.tiles_above == (1 if tiles else 4)
    assert fused.decode_stack.endswith(f"tiles {'on from 2 rows' if tiles else 'n/a'})")
    g = random.Random(5)
    prompts = [[g.randrange(4, 160) for _ in range(3 + 2 * i)] for i in range(16)]
    seqs = {r: [Seq(f"s{i}", list(p)) for i, p in enumerate(prompts)] for r in "fl"}
    allocs = {r: BlockAllocator(BLOCKS, seed=1) for r in "fl"}
    calls = []                    # what applies() said per step of the fused runner
    applies = fused.fused_decode.applies
    fused.fused_decode.applies = lambda batch: calls.append(applies(batch)) or calls[-1]
    for rows in (4, 1, 3, 2, 16, 4) if variant not in FEW else (4, 1, 3, 2, 4):
        for _ in range(3):
            out = {}
            # The whole rest of each sequence: a whole prompt (start 0, at most 33 tokens, so it runs as
            # operator rows) or one decode row; the stack takes the step when those rows fit its widest.
            width = sum(len(s.tokens) - s.computed for s in seqs["f"][:rows])
            for r, runner in (("f", fused), ("l", layers)):
                chunks = [s.chunk(len(s.tokens) - s.computed, allocs[r], BLOCK) for s in seqs[r][:rows]]
                out[r], _ = runner.logits(StepInput(chunks))
            assert calls[-1] == (width <= widest)
            # Quantized weights round each activation to int8 per block: an input one ulp apart (the
            # stack's and the layers' fp32 sums differ in order) may land on the other side of a rounding
            # tie and move by a whole int8 step, so they are held to int8's bound.
            assert_close(out["f"], out["l"], dtype=torch.int8 if variant in QUANTIZED else dtype,
                         k=TINY_SHAPE["k"], depth=TINY_SHAPE["depth"])
            for r in "fl":
                for s, row in zip(seqs[r][:rows], out["f"], strict=True):
                    s.tokens.append(int(row.argmax()))      # both follow the fused run's tokens
    assert sum(calls) >= 12 + 2 * (widest > 4)   # the decode steps (and short prefills) took the stack


def test_the_choice_is_made_from_measurement(folders):
    runner = Runner.from_folder(folders[CASES[0]], "fp32", block_size=BLOCK, num_blocks=BLOCKS, fast_paths=PINS)
    seen = []

    def timer(path, rows, fn):
        seen.append((path, rows))
        fn()
        return {"stack": 1.0 + (rows >= 3) * 5, "layers": 2.0, "tiles": 9.0}[path]

    fused, summary = FusedDecode.build(runner.model, runner.cache, runner.attention_backend, ExecutionPlan(),
                                       timer=timer)
    assert fused.max_rows == 2 and summary.startswith("cpp rows<=2; timed 1 row 1000.0 vs 2000.0 ms")
    assert [s for s in seen if s[0] != "tiles"] == [(path, rows) for rows in (1, 2, 3) for path in ("stack", "layers")]
    assert all(not k.any() for k in runner.cache.k) and all(not v.any() for v in runner.cache.v)

    fused, summary = FusedDecode.build(runner.model, runner.cache, runner.attention_backend, ExecutionPlan(),
                                       timer=lambda path, rows, fn: 1.0)
    assert fused is None and summary.startswith("off (the layers were as fast); timed 1 row 1000.0 vs 1000.0 ms")

    # A tie (within plan.TIE) at some counts does not stop the stack at the larger ones where it wins (a large model's
    # few-row steps, where it saves less than the margin); the first count where the layers win does.
    layers = {1: 1.02, 2: 1.02, 3: 2.0, 4: 1.02, 5: 1.02, 6: 1.02, 8: 1.02, 16: 1.3, 64: 1.02}
    fused, summary = FusedDecode.build(runner.model, runner.cache, runner.attention_backend, ExecutionPlan(),
                                       timer=lambda path, rows, fn: 1.0 if path == "stack" else layers[rows])
    assert fused.max_rows == 64
    layers[64] = 0.9
    fused, summary = FusedDecode.build(runner.model, runner.cache, runner.attention_backend, ExecutionPlan(),
                                       timer=lambda path, rows, fn: 1.0 if path == "stack" else layers[rows])
    assert fused.max_rows == 16 and summary.startswith("cpp rows<=16")


PANEL_VARIANTS = [v for v, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))
                  if tile_gemm_cpu.available(dtype)]
NEEDS_PANELS = pytest.mark.skipif(not PANEL_VARIANTS, reason="no AVX-512: the panels are never built here "
                                  "(test_decode_steps_match_the_layers checks that)")


def _build_with_panels(folders, record: ExecutionPlan, timer):
    """FusedDecode.build on the first case in a dtype the panel kernel runs here -> (fused, summary)."""
    runner = Runner.from_folder(folders[CASES[0]], PANEL_VARIANTS[0], block_size=BLOCK, num_blocks=BLOCKS,
                                fast_paths=PINS)
    return FusedDecode.build(runner.model, runner.cache, runner.attention_backend, record, timer=timer)


# (tiles' time at 2, 3 and 4 rows, at 16 rows, at 64 rows, kept, the fewest rows they run at) with the stack at 1.0:
# they would run at 16 and 64 rows and from the fewest rows down to which they beat the stack at every count; kept only
# when faster at 16 and 64 rows and by the tie rule over the counts they would run at.
PANEL_CHOICES = [((0.5, 0.5, 0.5), 0.5, 1.5, False, None),     # slower at 64 rows
                 ((0.7, 0.7, 0.7), 0.7, 1.01, False, None),    # ahead by 15% over both, but slower at 64 rows
                 ((0.98, 0.98, 0.98), 0.98, 0.98, False, None),   # faster at each, but by 2% only
                 ((0.8, 0.8, 0.8), 0.97, 0.98, True, 2),       # by 2-3% above 4 rows, by 20% at the 2-4 they run too
                 ((1.0, 0.8, 0.8), 0.97, 0.98, True, 3),       # the same, tied at 2 rows: 11% over 3, 4, 16 and 64
                 ((1.0, 1.0, 0.92), 0.97, 0.98, False, None),  # ahead at 4 rows, by 4.3% over 4, 16 and 64 only
                 ((0.9, 0.9, 0.9), 0.9, 0.99, True, 2),         # faster at each, by 5.8% over both, and at 2-4 rows
                 ((1.0, 0.9, 0.9), 0.9, 0.99, True, 3),         # tied at 2 rows
                 ((0.9, 1.0, 0.9), 0.9, 0.99, True, 4),         # tied at 3 rows: not at 2 either
                 ((0.9, 0.9, 1.0), 0.9, 0.99, True, 5)]         # tied at 4 rows: above 4 only


@NEEDS_PANELS
@pytest.mark.parametrize("few,at16,at64,kept,least", PANEL_CHOICES)
def test_the_panels_run_only_where_they_were_faster(folders, few, at16, at64, kept, least):
    seen = []

    def timer(path, rows, fn):
        seen.append((path, rows))
        fn()
        return {"stack": 1.0, "layers": 2.0, "tiles": few[rows - 2] if rows <= 4 else at16 if rows < 64 else at64}[path]

    fused, summary = _build_with_panels(folders, ExecutionPlan(), timer)
    assert fused.tiles == kept and fused.tiled is None and fused.max_rows == 64
    assert f"16 rows 1000.0 (tiles {at16 * 1000:.1f}) vs 2000.0 ms" in summary
    assert summary.endswith(f"tiles {f'on from {least} rows' if kept else 'off'})")
    assert fused.tiles_above == (least - 1 if kept else decode_stack_cpu.TILES_ABOVE)
    assert [rows for path, rows in seen if path == "tiles"] == [2, 3, 4, 5, 6, 8, 16, 64]


@NEEDS_PANELS
@pytest.mark.parametrize("at, kept, least", [({5: 1.2, 6: 1.2}, True, 7),    # they lose at 5-6 rows, win from 8
                                            ({8: 1.2}, True, 9),             # they lose at 8
                                            ({3: 1.2}, True, 4),             # they lose at 3, win at 2 and 4
                                            ({5: 1.02, 6: 1.04}, True, 2)])  # tied at 5-6 rows: the same
def test_the_panels_never_run_where_the_few_row_kernel_beats_them(folders, at, kept, least):
    """Up to the few-row kernel's MAX_ROWS, a count where it beats the panels (plan.beats) is run by it, and so is
    every count below it; the panels at 0.9 of the stack elsewhere."""
    def timer(path, rows, fn):
        fn()
        return {"stack": 1.0, "layers": 2.0, "tiles": at.get(rows, 0.9)}[path]

    fused, summary = _build_with_panels(folders, ExecutionPlan(), timer)
    assert fused.tiles == kept and fused.tiles_above == least - 1
    assert summary.endswith(f"tiles on from {least} rows)")


def _panel_timer(tiles: float, seen: list):
    """A timer with the stack at 1.0, the layers at 2.0 and the panels at `tiles` at every count."""
    def timer(path, rows, fn):
        seen.append(path)
        fn()
        return {"stack": 1.0, "layers": 2.0, "tiles": tiles}[path]
    return timer


@NEEDS_PANELS
@pytest.mark.parametrize("pin,tiles,kept", [("off", 0.5, False), ("on", 1.5, True), ("auto", 0.5, True)])
def test_the_panels_pinned(folders, pin, tiles, kept):
    """decode_panels=off never builds them, even where they would win; on keeps them, even where they lose."""
    seen, record = [], ExecutionPlan(f"decode_panels={pin}")
    fused, _ = _build_with_panels(folders, record, _panel_timer(tiles, seen))
    assert fused.tiles == kept and ("tiles" in seen) == (pin != "off")
    assert record.chosen("decode_panels") == ("on from 2 rows" if pin == "auto" else "on from 5 rows" if kept
                                              else "off")
    assert record.get("decode_panels").reason == {"off": "--fast-paths decode_panels=off",
                                                  "on": "pinned by --fast-paths decode_panels=on", "auto": ""}[pin]


@NEEDS_PANELS
@pytest.mark.parametrize("pin", ["auto", "on"])
def test_the_panels_need_room(folders, monkeypatch, pin):
    """Timed (auto) only where a copy of the layers' dense weights fits in half the memory available; pinned on,
    built anyway."""
    monkeypatch.setattr(fused_decode, "available_memory", lambda: 4096)
    seen, record = [], ExecutionPlan(f"decode_panels={pin}")
    fused, _ = _build_with_panels(folders, record, _panel_timer(0.5, seen))
    assert fused.tiles == (pin == "on") and ("tiles" in seen) == (pin == "on")
    if pin == "auto":
        assert record.chosen("decode_panels") == "off"
        assert "more than half the memory available beside the KV cache" in record.get("decode_panels").reason


@pytest.mark.parametrize("limit,expected", [("1610612736", 1 << 29), ("max", None)])
def test_available_memory_follows_the_cgroup(tmp_path, monkeypatch, limit, expected):
    """A container's limit less its use, where that is less than the host's MemAvailable; "max" is no limit."""
    host = fused_decode.available_memory()
    assert host > 0                     # this Linux's /proc/meminfo
    (tmp_path / "max").write_text(limit + "\n")
    (tmp_path / "current").write_text(str(1 << 30) + "\n")
    monkeypatch.setattr(fused_decode, "CGROUP_FILES", ((str(tmp_path / "max"), str(tmp_path / "current")),))
    got = fused_decode.available_memory()
    if expected is not None:
        assert got == expected          # 1.5 GiB less 1 GiB in use: below any machine these tests run on
    else:
        assert abs(got - host) < host / 10     # the host's figure, give or take what moved between the reads


def test_when_it_stays_off(folders):
    runner = Runner.from_folder(folders[CASES[0]], "fp32", block_size=BLOCK, num_blocks=BLOCKS, fast_paths=PINS)
    assert FusedDecode.build(runner.model, runner.cache, "torch-gather", ExecutionPlan()) == \
        (None, "off (decode attention is torch-gather)")
    pinned = ExecutionPlan("linear=plain")
    assert FusedDecode.build(runner.model, runner.cache, runner.attention_backend, pinned) == \
        (None, "off (the matmul path is pinned (--fast-paths linear=plain))")
    assert pinned.chosen("decode_stack") == "off"
    off = ExecutionPlan("decode_stack=off")
    assert FusedDecode.build(runner.model, runner.cache, runner.attention_backend, off) == \
        (None, "off (--fast-paths decode_stack=off)")
    with pytest.raises(ValueError, match="decode_stack=on: the decode stack cannot run here"):
        FusedDecode.build(runner.model, runner.cache, "torch-gather", ExecutionPlan("decode_stack=on"))
    forced = Runner.from_folder(folders[CASES[0]], "fp32", block_size=BLOCK, num_blocks=BLOCKS,
                                fast_paths="linear=plain,attention=cpp")
    assert forced.fused_decode is None and forced.plan.chosen("decode_stack") == "off"


@pytest.mark.parametrize("stack", ["on", "off"])
def test_a_timed_torch_attention_does_not_keep_the_stack_out(folders, monkeypatch, stack):
    """Where the layers' attention alone timed faster in torch (not pinned), the stack is still built and chosen
    by its own rule; when it runs, so does the operator (its steps carry the operator's metadata), said so."""
    monkeypatch.setattr(attention, "_time_decode", lambda rows, *shape: {"cpp": 2e-3, "torch": 1e-3})
    runner = Runner.from_folder(folders[CASES[0]], "fp32", block_size=BLOCK, num_blocks=BLOCKS,
                                fast_paths=f"decode_stack={stack}")
    chosen = runner.plan.get("attention")
    assert [t.candidate for t in chosen.timings] == ["cpp", "torch"] * len(attention.TIMING_ROWS)
    if stack == "on":
        assert runner.fused_decode is not None and runner.attention_backend == attention.CPP
        assert chosen.chosen == "cpp" and chosen.reason.startswith("the decode stack runs, and its steps need")
    else:
        assert runner.fused_decode is None and runner.attention_backend == attention.TORCH
        assert chosen.chosen == "torch" and runner.plan.chosen("decode_stack") == "off"
    calls = []
    if runner.fused_decode is not None:
        applies = runner.fused_decode.applies
        runner.fused_decode.applies = lambda batch: calls.append(applies(batch)) or calls[-1]
    seq, alloc = Seq("s", [5, 9, 14, 3, 7]), BlockAllocator(BLOCKS, seed=1)
    for n in (5, 1):            # a short prompt (operator rows), then a decode step
        logits, _ = runner.logits(StepInput([seq.chunk(n, alloc, BLOCK)]))
        seq.tokens.append(int(logits[-1].argmax()))
    assert torch.isfinite(logits).all() and calls == ([True, True] if stack == "on" else [])


@pytest.mark.parametrize("quantization,many", [("int8", "int8_gemm"), ("int4", "grouped_matmul")])
def test_quantized_weights_run_in_the_stack_only_as_their_linears_do(folders, quantization, many):
    """gemv off: a quantized projection's Linear runs its many-row path at every row count, so the stack takes
    no step unless that path is widen_gemm's (which it runs too), and then every row count."""
    args = dict(block_size=BLOCK, num_blocks=BLOCKS, quantization=quantization)
    library = "int8pack" if quantization == "int8" else "dequant"
    runner = Runner.from_folder(folders[CASES[0]], "fp32", fast_paths=f"{PINS},gemv=off,{many}={library}", **args)
    assert runner.fused_decode is None
    assert runner.plan.get("decode_stack").reason == ("a quantized projection runs neither the few-row kernel (gemv "
                                                      "off) nor widen_gemm_cpu's many-row matmul")
    with pytest.raises(ValueError, match="decode_stack=on: the decode stack cannot run here"):
        Runner.from_folder(folders[CASES[0]], "fp32", fast_paths=f"{PINS},gemv=off,{many}={library},decode_stack=on",
                           **args)
    if not widen_gemm_cpu.available(torch.float32):
        return
    runner = Runner.from_folder(folders[CASES[0]], "fp32", fast_paths=f"{PINS},gemv=off,{many}=tiles,decode_stack=on",
                                **args)
    assert runner.fused_decode is not None and runner.fused_decode.max_rows == 64


def test_pinned_on_takes_every_timed_row_count_untimed(folders):
    runner = Runner.from_folder(folders[CASES[0]], "fp32", block_size=BLOCK, num_blocks=BLOCKS,
                                fast_paths="attention=cpp,decode_stack=on")
    assert runner.fused_decode is not None and runner.fused_decode.max_rows == 64
    assert runner.plan.chosen("decode_stack") == "on rows<=64" and not runner.plan.get("decode_stack").timings


def test_prefill_adapter_and_wide_steps_take_the_layers(folders):
    fused, _ = runners(folders[CASES[0]], "fp32")
    alloc = BlockAllocator(BLOCKS)
    seqs = [Seq(f"s{i}", list(range(5, 12))) for i in range(5)]

    def batch(chunks) -> StepBatch:
        return StepBatch.build(StepInput(chunks), BLOCK, torch.device("cpu"), None, attention.CPP)

    long = Seq("long", [5 + i % 50 for i in range(attention.FIRST_CHUNK_IN_PLACE_MAX + 1)])
    assert not fused.fused_decode.applies(batch([long.chunk(len(long.tokens), alloc, BLOCK)]))
    prefill = [s.chunk(7, alloc, BLOCK) for s in seqs]
    assert fused.fused_decode.applies(batch(prefill[:1]))          # a short whole prompt runs as rows
    fused.logits(StepInput(prefill))
    for s in seqs:
        s.tokens.append(9)
    decode = [s.chunk(1, alloc, BLOCK) for s in seqs]
    assert fused.fused_decode.applies(batch(decode))
    fused.fused_decode.max_rows = 4                                       # as if it won up to 4 rows only
    assert fused.fused_decode.applies(batch(decode[:4]))
    assert not fused.fused_decode.applies(batch(decode))
    assert not fused.fused_decode.applies(batch(decode[:1] + prefill[:1]))
    adapter = batch(decode[:4])
    adapter.lora_spans = [(0, 1, 0)]
    assert not fused.fused_decode.applies(adapter)
