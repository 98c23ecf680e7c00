"""The few-row decode stack (kernels/decode_stack_cpu.cpp) against its torch reference, and its refusals."""
from __future__ import annotations

import pytest
import torch

from services.common import linear_path
from services.decoder.kernels import widen_gemm_cpu
from services.decoder.kernels.decode_stack_cpu import (
    KERNEL_ROWS,
    NUM_TARGETS,
    LayerWeights,
    Projection,
    Shape,
    StackLora,
    decode_stack,
    decode_stack_ref,
    make_stack,
    set_arenas,
)
from services.decoder.kernels.gemv_cpu import BF16_ROWS
from services.decoder.kernels.gemv_grouped_cpu import WIDEST
from services.decoder.kernels.lora_cpu import PREFETCH
from services.decoder.model import grouped
from services.decoder.model.quantization import quantize
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32, "int4": torch.float32,
          "int4_bf16": torch.bfloat16, "q8g16": torch.float32}
# Grouped weights (model/grouped.py): kind -> (bits, group).
GROUPED = {"int4": (4, 32), "int4_bf16": (4, 16), "q8g16": (8, 16)}
LAYERS = 2


def projection(kind: str, out: int, inp: int, bias: bool, g: torch.Generator, library: str,
               gemv_rows: int = KERNEL_ROWS) -> Projection:
    """library: how rows above gemv_rows run: "plain", "packed", "both" (packed from 8 rows on), or
    "widened" (packed, from a copy widened to fp32: linear_path's per-shape choice for bf16); for int8 and grouped
    weights "widen" (widen_gemm_cpu above the few-row kernel), "amx" (the same on the tile unit) or anything else
    (refused there)."""
    w = torch.randn(out, inp, generator=g) / inp ** 0.5
    b = torch.randn(out, generator=g).to(DTYPES[kind]) * 0.1 if bias else None
    widen = {"widen": widen_gemm_cpu.products_for(DTYPES[kind]), "amx": torch.bfloat16}.get(library)
    kernel = "amx" if library == "amx" else "dot"
    if kind == "int8":
        q, scale = quantize(w)
        return Projection(q, scale, b, gemv_rows, widen=widen, kernel=kernel)
    if kind in GROUPED:
        gw = grouped.quantize(w, *GROUPED[kind])
        return Projection(gw.codes, gw.scale, b, gemv_rows, offset=gw.offset, bits=gw.bits, group=gw.group,
                          widen=widen, kernel=kernel)
    w = w.to(DTYPES[kind])
    if library == "plain":
        return Projection(w, None, b, gemv_rows)
    rule = ((1, 8), (False, True)) if library == "both" else ((1,), (True,))
    copy = torch.float32 if library == "widened" else None
    return Projection(w, None, b, gemv_rows, linear_path.pack(w, copy), rule)


def model(kind: str, shape: Shape, qk_norm: bool, bias: bool, num_blocks: int, block_size: int, g: torch.Generator,
          library: str = "plain", gemv_rows: int = KERNEL_ROWS):
    dtype = DTYPES[kind]
    h, kvh, d = shape.heads, shape.kv_heads, shape.head_dim

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    layers = []
    for _ in range(LAYERS):
        cache = [torch.randn(num_blocks, block_size, kvh, d, generator=g).to(dtype) for _ in range(2)]
        layers.append(LayerWeights(
            norm(shape.hidden), norm(shape.hidden),
            projection(kind, (h + 2 * kvh) * d, shape.hidden, bias, g, library, gemv_rows),
            projection(kind, shape.hidden, h * d, False, g, library, gemv_rows),
            projection(kind, 2 * shape.intermediate, shape.hidden, False, g, library, gemv_rows),
            projection(kind, shape.hidden, shape.intermediate, False, g, library, gemv_rows),
            *cache, norm(d) if qk_norm else None, norm(d) if qk_norm else None))
    return layers, norm(shape.hidden)


def step(rows: int, lengths: list[int], block_size: int, num_blocks: int, shape: Shape, dtype, g):
    """Random rows at the given context lengths over disjoint, shuffled blocks."""
    perm = torch.randperm(num_blocks, generator=g).tolist()
    per_row = -(-max(lengths) // block_size)
    tables = torch.tensor([perm[r * per_row:(r + 1) * per_row] for r in range(rows)], dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    pos = lens.long() - 1
    slots = tables.long().gather(1, (pos // block_size)[:, None])[:, 0] * block_size + pos % block_size
    angles = pos.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim))
    angles = torch.cat((angles, angles), dim=-1)
    sin = angles.sin()
    sin[:, :shape.head_dim // 2].neg_()
    x = torch.randn(rows, shape.hidden, generator=g).to(dtype)
    return x, angles.cos().to(dtype), sin.to(dtype), slots, tables, lens


def clone(layers: list[LayerWeights]) -> list[LayerWeights]:
    return [LayerWeights(**{**w.__dict__, "k_cache": w.k_cache.clone(), "v_cache": w.v_cache.clone()})
            for w in layers]


def run_loop(layers: list[LayerWeights], loop: str) -> None:
    """Every projection's few-row kernel runs `loop`: over bf16 x and weights one of gemv_cpu.BF16_ROWS, over grouped
    weights one of gemv_grouped_cpu.WIDEST."""
    for w in layers:
        for p in (w.qkv, w.o, w.gate_up, w.down):
            if loop in BF16_ROWS:
                p.bf16_row = loop
            else:
                p.grouped_loop = loop


def check(kind, rows, heads, kv_heads, head_dim, block_size, qk_norm, bias, library="plain", gemv_rows=KERNEL_ROWS,
          loop=BF16_ROWS[0]):
    g = torch.Generator().manual_seed(rows * 100 + heads * 10 + block_size)
    shape = Shape(heads, kv_heads, head_dim, hidden=64, intermediate=96, eps=1e-5)
    lengths = [1 + (37 * r + 2 * block_size * (r % 2)) % 40 for r in range(rows)]
    num_blocks = rows * -(-40 // block_size) + 8
    layers, final = model(kind, shape, qk_norm, bias, num_blocks, block_size, g, library, gemv_rows)
    run_loop(layers, loop)
    x, cos, sin, slots, tables, lens = step(rows, lengths, block_size, num_blocks, shape, DTYPES[kind], g)
    ref_layers = clone(layers)
    expected = decode_stack_ref(shape, ref_layers, final, x.clone(), cos, sin, slots, tables, lens)
    got = decode_stack(make_stack(shape, layers, final), x.clone(), cos, sin, slots, tables, lens)
    # Each layer: two norms, four matmuls (k up to the intermediate width) and a softmax over <= 40 keys.
    depth = 6 * LAYERS + 1
    # Grouped weights round each projection's input to int8 steps per group, in the stack and in the reference
    # alike; but an input the two compute an ulp apart can round to neighbouring steps where it sits on a tie
    # (seen here once in ~50 cases), so their bound is int8's (tests/tolerance.py). The kernel alone is held to
    # fp32's bound against the same rounding in tests/decoder/kernels/test_gemv_grouped_cpu.py.
    # Above the few-row kernel, widen_gemm may round x to bf16, where an ulp apart can land on neighbouring steps too.
    bound = torch.int8 if kind in GROUPED or library in ("widen", "amx") else DTYPES[kind]
    assert_close(got, expected, dtype=bound, k=shape.intermediate, depth=depth)
    for mine, ref in zip(layers, ref_layers, strict=True):   # the same K/V written at the same slots
        assert_close(mine.k_cache, ref.k_cache, dtype=bound, k=shape.intermediate, depth=depth)
        assert_close(mine.v_cache, ref.v_cache, dtype=bound, k=shape.intermediate, depth=depth)


# Row counts up to the few-row kernel's: within its first pass of PASS_ROWS (4) rows, and into its second.
FEW_ROWS = (1, 3, 4, 5, KERNEL_ROWS)
SHAPES = [
    (4, 1, 16, 16, False, False),     # GQA 4, one block per 16 keys
    (6, 2, 64, 4, True, True),        # GQA 3, Qwen3-style per-head norms, Qwen2-style qkv bias
    (4, 4, 32, 1, False, True),       # MHA, a block per key
]


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", *GROUPED])
@pytest.mark.parametrize("rows", FEW_ROWS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,qk_norm,bias", SHAPES)
def test_few_rows_match_reference(kind, rows, heads, kv_heads, head_dim, block_size, qk_norm, bias):
    check(kind, rows, heads, kv_heads, head_dim, block_size, qk_norm, bias)


@pytest.mark.parametrize("loop", BF16_ROWS)
@pytest.mark.parametrize("rows", FEW_ROWS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,qk_norm,bias", SHAPES)
def test_bf16_loops_match_reference(loop, rows, heads, kv_heads, head_dim, block_size, qk_norm, bias):
    check("bf16", rows, heads, kv_heads, head_dim, block_size, qk_norm, bias, loop=loop)


@pytest.mark.parametrize("kind", GROUPED)
@pytest.mark.parametrize("loop", WIDEST)
@pytest.mark.parametrize("rows", [1, KERNEL_ROWS])
def test_grouped_loops_match_reference(kind, loop, rows):
    check(kind, rows, *SHAPES[1], loop=loop)


@pytest.mark.parametrize("kind,library", [(k, lib) for k in ("fp32", "bf16") for lib in ("plain", "packed", "both")]
                         + [("bf16", "widened")])     # only a bf16 weight has a wider copy
@pytest.mark.parametrize("rows,gemv_rows", [(2, 1), (KERNEL_ROWS + 1, KERNEL_ROWS), (16, 2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,qk_norm,bias", SHAPES[:2])
def test_rows_past_gemv_rows_run_the_library_matmuls(kind, rows, gemv_rows, library, heads, kv_heads, head_dim,
                                                     block_size, qk_norm, bias):
    if library != "plain" and linear_path.pack_dtype(DTYPES[kind]) is None:
        pytest.skip(linear_path.pack_error(DTYPES[kind]))     # oneDNN cannot pack this dtype on this CPU
    check(kind, rows, heads, kv_heads, head_dim, block_size, qk_norm, bias, library, gemv_rows)


@pytest.mark.parametrize("kind", ["int8", *GROUPED])
@pytest.mark.parametrize("rows", [KERNEL_ROWS + 1, 13])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,qk_norm,bias", SHAPES[:2])
@pytest.mark.parametrize("kernel", ["widen", "amx"])
def test_quantized_rows_past_the_kernel_run_widen_gemm(kind, rows, heads, kv_heads, head_dim, block_size, qk_norm,
                                                       bias, kernel):
    if not (widen_gemm_cpu.amx() if kernel == "amx" else widen_gemm_cpu.available(DTYPES[kind])):
        pytest.skip(f"no widen_gemm_cpu {kernel} kernel on this CPU (test_widen_gemm_cpu checks where); such "
                    "weights are refused above the few-row kernel (test_refusals)")
    check(kind, rows, heads, kv_heads, head_dim, block_size, qk_norm, bias, library=kernel)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3])
def test_quantized_rows_past_a_lower_gemv_rows_run_widen_gemm(kind, rows):
    """gemv_rows below the kernel's (gemv off: 0) sends even one row to widen_gemm, as the Linear does."""
    if not widen_gemm_cpu.available(DTYPES[kind]):
        pytest.skip("no widen_gemm_cpu kernel on this CPU (test_widen_gemm_cpu checks where)")
    check(kind, rows, *SHAPES[0], library="widen", gemv_rows=rows - 1)


@pytest.mark.parametrize("kind,loop", [("fp32", BF16_ROWS[0])] + [("bf16", loop) for loop in BF16_ROWS]
                         + [(k, loop) for k in GROUPED for loop in WIDEST])
@pytest.mark.parametrize("lora", [False, True])
def test_a_row_is_independent_of_the_others_and_the_thread_count_bit_for_bit(kind, loop, lora):
    g = torch.Generator().manual_seed(7)
    shape = Shape(4, 2, 64, hidden=128, intermediate=192, eps=1e-6)
    layers, final = model(kind, shape, False, True, 64, 16, g)
    run_loop(layers, loop)
    x, cos, sin, slots, tables, lens = step(4, [5, 70, 33, 128], 16, 64, shape, DTYPES[kind], g)
    stack = make_stack(shape, layers, final)
    spans, row2 = (), ()
    if lora:    # rows 0 and 2 on one adapter, 3 on another, 1 on none
        set_arenas(stack, lora_arenas(shape, DTYPES[kind], g))
        offsets = torch.tensor([[0, 0, 0, 54]] * NUM_TARGETS, dtype=torch.int32)
        ranks = torch.tensor([[16, 0, 16, 13]] * NUM_TARGETS, dtype=torch.int32)
        spans, row2 = (offsets, ranks), (offsets[:, 2:3].contiguous(), ranks[:, 2:3].contiguous())
    caches = [(w.k_cache.clone(), w.v_cache.clone()) for w in layers]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        four = decode_stack(stack, x.clone(), cos, sin, slots, tables, lens, *spans)
        for w, (k, v) in zip(layers, caches, strict=True):
            w.k_cache.copy_(k)
            w.v_cache.copy_(v)
        torch.set_num_threads(1)
        one = decode_stack(stack, x[2:3].clone(), cos[2:3], sin[2:3], slots[2:3], tables[2:3], lens[2:3], *row2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], four[2])


def test_refusals():
    g = torch.Generator().manual_seed(3)
    shape = Shape(4, 2, 16, hidden=32, intermediate=48, eps=1e-6)
    layers, final = model("fp32", shape, False, False, 8, 4, g)
    stack = make_stack(shape, layers, final)
    x, cos, sin, slots, tables, lens = step(1, [3], 4, 8, shape, torch.float32, g)
    with pytest.raises(RuntimeError, match="no rows"):
        decode_stack(stack, x[:0], cos[:0], sin[:0], slots[:0], tables[:0], lens[:0])
    int8_layers, int8_final = model("int8", shape, False, False, 16, 4, g)
    past = step(KERNEL_ROWS + 1, [1] * (KERNEL_ROWS + 1), 4, 16, shape, torch.float32, g)
    with pytest.raises(RuntimeError, match=f"this int8 or grouped weight runs at most {KERNEL_ROWS} rows"):
        decode_stack(make_stack(shape, int8_layers, int8_final), *past)
    grouped_layers, grouped_final = model("q8g16", shape, False, False, 16, 4, g)
    with pytest.raises(RuntimeError, match=f"this int8 or grouped weight runs at most {KERNEL_ROWS} rows"):
        decode_stack(make_stack(shape, grouped_layers, grouped_final), *past)
    # gemv off (a projection's gemv_rows 0) and no widen_gemm: no rows at all, as its Linear would not run them there
    off_layers, off_final = model("int8", shape, False, False, 8, 4, g, gemv_rows=0)
    with pytest.raises(RuntimeError, match="this int8 or grouped weight runs at most 0 rows"):
        decode_stack(make_stack(shape, off_layers, off_final), x, cos, sin, slots, tables, lens)
    with pytest.raises(RuntimeError, match="slot 32 out of range"):
        decode_stack(stack, x, cos, sin, torch.tensor([32]), tables, lens)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        decode_stack(stack, x.bfloat16(), cos, sin, slots, tables, lens)
    with pytest.raises(RuntimeError, match="qkv must be"):
        bad = clone(layers)[0]
        bad.qkv = Projection(torch.randn(10, 32))
        make_stack(shape, [bad], final)
    with pytest.raises(RuntimeError, match="int8 and grouped weights and only they need a scale"):
        bad = clone(layers)[0]
        bad.o = Projection(torch.zeros(32, 64, dtype=torch.int8))
        make_stack(shape, [bad], final)


# LoRA in the stack: every layer has arenas for every target; rows mix adapters (some covering only q and v)
# with base rows.
LORA_SHAPE = (4, 2, 16, 4, True, True)      # GQA 2, per-head norms, qkv bias


def lora_arenas(shape: Shape, dtype, g: torch.Generator, p: int = 70):
    """Per layer {target: (A [p, K], Bt [p, N])} for all NUM_TARGETS targets, values that make O(1) corrections."""
    h, kvh, d, hid, inter = shape.heads, shape.kv_heads, shape.head_dim, shape.hidden, shape.intermediate
    widths = [(hid, h * d), (hid, kvh * d), (hid, kvh * d), (h * d, hid), (hid, inter), (hid, inter), (inter, hid)]
    return [{t: ((torch.randn(p, k, generator=g) / k ** 0.5).to(dtype), (torch.randn(p, n, generator=g) / 4).to(dtype))
             for t, (k, n) in enumerate(widths)} for _ in range(LAYERS)]


def lora_spans(rows: int, g: torch.Generator, p: int = 70):
    """offsets, ranks [NUM_TARGETS, rows]: about a third of the rows base (rank 0 everywhere), the others on one of
    five adapters of ranks 1 to 16 (consecutive rows often on the same one), adapter 1 covering q and v only."""
    adapters = [(0, 16), (16, 8), (24, 1), (25, 13), (54, 16)]
    offsets = torch.zeros(NUM_TARGETS, rows, dtype=torch.int32)
    ranks = torch.zeros(NUM_TARGETS, rows, dtype=torch.int32)
    for m in range(rows):
        which = int(torch.randint(-2, len(adapters), (1,), generator=g)) if m % 4 else (m // 4) % len(adapters)
        if which >= 0 and (rows == 1 or m != 1):
            o, r = adapters[which]
            targets = (0, 2) if which == 1 else range(NUM_TARGETS)
            for t in targets:
                offsets[t, m], ranks[t, m] = o, r
    return offsets, ranks


def run_lora(kind: str, rows: int, library: str = "plain", gemv_rows: int = KERNEL_ROWS, grain: int | None = None,
             prefetch: int = PREFETCH["paced"]):
    """(stack output with adapters, the ref's, the stack's without adapters, ranks); grain, prefetch:
    set_lora_reading's (grain None: the stack's default)."""
    heads, kv_heads, head_dim, block_size, qk_norm, bias = LORA_SHAPE
    g = torch.Generator().manual_seed(rows + 50)
    shape = Shape(heads, kv_heads, head_dim, hidden=64, intermediate=96, eps=1e-5)
    lengths = [1 + (37 * r + 2 * block_size * (r % 2)) % 40 for r in range(rows)]
    num_blocks = rows * -(-40 // block_size) + 8
    layers, final = model(kind, shape, qk_norm, bias, num_blocks, block_size, g, library, gemv_rows)
    x, cos, sin, slots, tables, lens = step(rows, lengths, block_size, num_blocks, shape, DTYPES[kind], g)
    arenas = lora_arenas(shape, DTYPES[kind], g)
    offsets, ranks = lora_spans(rows, g)
    ref_layers, base_layers = clone(layers), clone(layers)
    expected = decode_stack_ref(shape, ref_layers, final, x.clone(), cos, sin, slots, tables, lens,
                                StackLora(arenas, offsets, ranks))
    stack = make_stack(shape, layers, final)
    set_arenas(stack, arenas)
    if grain is not None:
        stack.set_lora_reading(grain, prefetch)
    got = decode_stack(stack, x.clone(), cos, sin, slots, tables, lens, offsets, ranks)
    base = decode_stack(make_stack(shape, base_layers, final), x.clone(), cos, sin, slots, tables, lens)
    for mine, ref in zip(layers, ref_layers, strict=True):
        assert_close(mine.k_cache, ref.k_cache, dtype=DTYPES[kind], k=shape.intermediate, depth=10 * LAYERS)
        assert_close(mine.v_cache, ref.v_cache, dtype=DTYPES[kind], k=shape.intermediate, depth=10 * LAYERS)
    return got, expected, base, ranks


@pytest.mark.parametrize("kind,rows,library,gemv_rows", [(k, r, "plain", KERNEL_ROWS) for k in ("fp32", "bf16")
                                                         for r in (1, 4, 16, 64)]
                         + [("int8", 1, "plain", KERNEL_ROWS), ("int8", 4, "plain", KERNEL_ROWS),
                            ("bf16", 16, "widened", KERNEL_ROWS), ("fp32", 3, "plain", 1)])
def test_lora_rows_match_reference_and_base_rows_are_untouched(kind, rows, library, gemv_rows):
    if library != "plain" and linear_path.pack_dtype(DTYPES[kind]) is None:
        pytest.skip(linear_path.pack_error(DTYPES[kind]))
    got, expected, base, ranks = run_lora(kind, rows, library, gemv_rows)
    # Each layer: the base's depth and two more products per projection with adapters.
    assert_close(got, expected, dtype=DTYPES[kind], k=96, depth=10 * LAYERS + 1)
    plain = (ranks == 0).all(dim=0)      # row 1 always, when there is one
    assert plain.any() == (rows > 1) and torch.equal(got[plain], base[plain])
    assert not torch.isclose(got[~plain], base[~plain]).all(dim=1).any()    # each adapter row changed


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
@pytest.mark.parametrize("prefetch", PREFETCH)
def test_lora_rows_split_into_a_task_per_block_give_the_same_bits(kind, prefetch):
    """The projections' targets' blocks in one parallel region (lora_rows.h), every block its own task on two
    threads (grain 1), asking for their next rows each way the plan may choose, equal the default grain's (these
    small rows: one task) bit for bit."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        split, _, _, _ = run_lora(kind, 16, grain=1, prefetch=PREFETCH[prefetch])
        whole, _, _, _ = run_lora(kind, 16)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(split, whole)


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_arenas_without_lora_rows_change_nothing_bit_for_bit(kind):
    """A stack holding arenas gives the no-adapter result with no spans, and with all ranks 0."""
    g = torch.Generator().manual_seed(21)
    shape = Shape(4, 2, 16, hidden=64, intermediate=96, eps=1e-5)
    layers, final = model(kind, shape, False, True, 40, 4, g)
    x, cos, sin, slots, tables, lens = step(4, [3, 9, 17, 30], 4, 40, shape, DTYPES[kind], g)
    runs = []
    for arenas, spans in ((False, False), (True, False), (True, True)):
        stack = make_stack(shape, clone(layers), final)
        if arenas:
            set_arenas(stack, lora_arenas(shape, DTYPES[kind], g))
        zero = torch.zeros(NUM_TARGETS, 4, dtype=torch.int32)
        runs.append(decode_stack(stack, x.clone(), cos, sin, slots, tables, lens, *((zero, zero) if spans else ())))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


def test_lora_refusals():
    g = torch.Generator().manual_seed(8)
    shape = Shape(4, 2, 16, hidden=64, intermediate=96, eps=1e-5)
    layers, final = model("fp32", shape, False, False, 16, 4, g)
    stack = make_stack(shape, layers, final)
    x, cos, sin, slots, tables, lens = step(2, [3, 5], 4, 16, shape, torch.float32, g)
    offsets = torch.zeros(NUM_TARGETS, 2, dtype=torch.int32)
    ranks = offsets.clone()
    ranks[2, 1] = 4
    with pytest.raises(RuntimeError, match="rows of target 2 have adapters but layer 0 has no arena"):
        decode_stack(stack, x, cos, sin, slots, tables, lens, offsets, ranks)
    with pytest.raises(RuntimeError, match=r"target 2 needs contiguous CPU A \[P, 64\] and Bt \[P, 32\]"):
        stack.set_lora(0, 2, torch.zeros(8, 64), torch.zeros(8, 64))
    with pytest.raises(RuntimeError, match="in the model's dtype"):
        stack.set_lora(0, 2, torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16))
    set_arenas(stack, [{2: (torch.zeros(3, 64), torch.zeros(3, 32))}] * LAYERS)
    with pytest.raises(RuntimeError, match=r"row 1 reads arena rows \[0, 4\) of 3"):
        decode_stack(stack, x, cos, sin, slots, tables, lens, offsets, ranks)
    with pytest.raises(RuntimeError, match="must be contiguous int32"):
        decode_stack(stack, x, cos, sin, slots, tables, lens, offsets[:, :1], ranks[:, :1])
