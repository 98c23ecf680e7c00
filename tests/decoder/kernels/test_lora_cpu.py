"""The multi-LoRA CPU kernel (kernels/lora_cpu.cpp, lora_rows.h) against its torch reference, and its refusals."""
from __future__ import annotations

import pytest
import torch

from services.decoder.kernels.lora import grouped_lora_ref
from services.decoder.kernels.lora_cpu import (
    GRAINS,
    PREFETCH,
    last_level_cache,
    lora_rows,
    lora_rows_ref,
    lora_rows_torch,
    time_reading,
)
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_RANK = 16
# Row layouts: the lengths of consecutive runs of rows on one adapter (a prefill chunk is one run).
LAYOUTS = {
    "one row": [1],
    "runs": [1, 3, 17, 1, 1, 3, 2, 1, 17, 1, 3, 14],
    "one run of 64": [64],
    "64 lone rows": [1] * 64,
}


def arena(p: int, k: int, n: int, dtype: torch.dtype, g: torch.Generator):
    """A [p, k], Bt [p, n] scaled so that y and a rank-16 correction are both O(1)."""
    return ((torch.randn(p, k, generator=g) / k ** 0.5).to(dtype),
            (torch.randn(p, n, generator=g) / MAX_RANK ** 0.5).to(dtype))


def spans(runs: list[int], p: int, g: torch.Generator):
    """offsets, ranks [sum(runs)] int32: each run one random (offset, rank in 0..MAX_RANK) anywhere in p rows;
    rank-0 runs get offsets past the arena (nothing may be read for them)."""
    offsets, ranks = [], []
    for length in runs:
        r = int(torch.randint(0, MAX_RANK + 1, (1,), generator=g))
        o = int(torch.randint(0, p - r + 1, (1,), generator=g)) if r else p + 1000
        offsets += [o] * length
        ranks += [r] * length
    return torch.tensor(offsets, dtype=torch.int32), torch.tensor(ranks, dtype=torch.int32)


def case(kind: str, runs: list[int], k: int, n: int, seed: int, p: int = 300):
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[kind]
    A, Bt = arena(p, k, n, dtype, g)
    offsets, ranks = spans(runs, p, g)
    m = len(offsets)
    x, y = torch.randn(m, k, generator=g).to(dtype), torch.randn(m, n, generator=g).to(dtype)
    return y, x, A, Bt, offsets, ranks


@pytest.mark.parametrize("kind", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k,n", [(576, 576), (576, 192), (576, 1536), (1536, 576), (100, 100), (7, 33)])
def test_matches_reference(kind, layout, k, n):
    y, x, A, Bt, offsets, ranks = case(kind, LAYOUTS[layout], k, n, seed=k + n + len(LAYOUTS[layout]))
    expected = lora_rows_ref(y, x, A, Bt, offsets, ranks)
    got = lora_rows(y.clone(), x, A, Bt, offsets, ranks)
    assert got.dtype == y.dtype and got.shape == y.shape
    assert_close(got, expected, dtype=DTYPES[kind], k=k, depth=2)
    base = ranks == 0
    assert torch.equal(got[base], y[base])      # rank 0: exactly nothing, whatever its offset says


@pytest.mark.parametrize("kind", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_form_matches_reference(kind, layout):
    """The pool's path where the operator cannot be built: the same contract, in place."""
    y, x, A, Bt, offsets, ranks = case(kind, LAYOUTS[layout], 576, 192, seed=len(LAYOUTS[layout]))
    expected = lora_rows_ref(y, x, A, Bt, offsets, ranks)
    got = y.clone()
    assert lora_rows_torch(got, x, A, Bt, offsets, ranks) is got
    assert_close(got, expected, dtype=DTYPES[kind], k=576, depth=2)
    base = ranks == 0
    assert torch.equal(got[base], y[base])


@pytest.mark.parametrize("kind", DTYPES)
def test_every_rank_from_1_to_16_at_any_offset(kind):
    """One lone row per rank, each at an odd offset, and the last rows of the arena."""
    g = torch.Generator().manual_seed(5)
    dtype, k, n, p = DTYPES[kind], 576, 192, 211
    A, Bt = arena(p, k, n, dtype, g)
    ranks = torch.arange(1, MAX_RANK + 2, dtype=torch.int32).clamp(max=MAX_RANK)
    offsets = torch.tensor([3 * r + 1 for r in range(MAX_RANK)] + [p - MAX_RANK], dtype=torch.int32)
    x, y = torch.randn(len(ranks), k, generator=g).to(dtype), torch.randn(len(ranks), n, generator=g).to(dtype)
    got = lora_rows(y.clone(), x, A, Bt, offsets, ranks)
    assert_close(got, lora_rows_ref(y, x, A, Bt, offsets, ranks), dtype=dtype, k=k, depth=2)


@pytest.mark.parametrize("kind", DTYPES)
@pytest.mark.parametrize("grain", [*GRAINS, "every block"])
@pytest.mark.parametrize("prefetch", PREFETCH)
def test_a_row_is_independent_of_the_others_and_the_thread_count_bit_for_bit(kind, grain, prefetch):
    """Each row alone on one thread equals the same row inside runs of 17 (split in blocks) on two threads, with
    each grain the plan chooses from (and one that gives every block its own task), asking ahead or not."""
    y, x, A, Bt, offsets, ranks = case(kind, LAYOUTS["runs"], 576, 576, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        together = lora_rows(y.clone(), x, A, Bt, offsets, ranks, GRAINS.get(grain, 1), PREFETCH[prefetch])
        torch.set_num_threads(1)
        alone = torch.cat([lora_rows(y[i:i + 1].clone(), x[i:i + 1], A, Bt, offsets[i:i + 1], ranks[i:i + 1])
                           for i in range(len(y))])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("kind", DTYPES)
def test_interleaved_rows_on_one_adapter_match_reference(kind):
    """Rows on the same adapter need not be consecutive (they share blocks all the same)."""
    g = torch.Generator().manual_seed(11)
    dtype, k, n = DTYPES[kind], 576, 576
    A, Bt = arena(64, k, n, dtype, g)
    offsets = torch.tensor([0, 16, 0, 32, 0, 16] * 4, dtype=torch.int32)
    ranks = torch.tensor([16, 8, 16, 4, 16, 8] * 4, dtype=torch.int32)
    x, y = torch.randn(24, k, generator=g).to(dtype), torch.randn(24, n, generator=g).to(dtype)
    got = lora_rows(y.clone(), x, A, Bt, offsets, ranks)
    assert_close(got, lora_rows_ref(y, x, A, Bt, offsets, ranks), dtype=dtype, k=k, depth=2)


@pytest.mark.parametrize("kind", DTYPES)
def test_strided_rows_of_a_wider_output(kind):
    """y may be a column slice of a fused projection's output (e.g. v of qkv); x a slice of a wider input."""
    y, x, A, Bt, offsets, ranks = case(kind, LAYOUTS["runs"], 96, 40, seed=13)
    wide = torch.randn(len(y), 100).to(y.dtype)
    wide[:, 30:70] = y
    xs = torch.cat((x, torch.randn(len(x), 5).to(x.dtype)), dim=1)[:, :96]
    lora_rows(wide[:, 30:70], xs, A, Bt, offsets, ranks)
    assert_close(wide[:, 30:70], lora_rows_ref(y, x, A, Bt, offsets, ranks), dtype=y.dtype, k=96, depth=2)


@pytest.mark.parametrize("kind", DTYPES)
@pytest.mark.parametrize("true_ranks", [[16, 16, 16], [4, 16, 1, 8]])
def test_slot_shaped_arena_matches_grouped_reference(kind, true_ranks):
    """An arena holding a slot bank (A [S, R, K] as [S R, K], Bt from B [S, N, R]) computes the spec's grouped
    reference: slot s at offset s R (its zero-padded rows add nothing), slot -1 rows rank 0."""
    g = torch.Generator().manual_seed(len(true_ranks))
    dtype, k, n, r = DTYPES[kind], 576, 192, MAX_RANK
    s = len(true_ranks)
    A, B = torch.zeros(s, r, k), torch.zeros(s, n, r)
    for i, t in enumerate(true_ranks):
        A[i, :t] = torch.randn(t, k, generator=g) / k ** 0.5
        B[i, :, :t] = torch.randn(n, t, generator=g) / t ** 0.5
    A, B = A.to(dtype), B.to(dtype)
    slots = torch.tensor([0, 0, -1, 1, 2, 2, 2, -1] + [s - 1] * 17 + list(range(s)), dtype=torch.int64)
    x, y = torch.randn(len(slots), k, generator=g).to(dtype), torch.randn(len(slots), n, generator=g).to(dtype)
    expected = y + grouped_lora_ref(x, A, B, slots)
    offsets = (slots.clamp(min=0) * r).to(torch.int32)
    ranks = torch.where(slots >= 0, r, 0).to(torch.int32)
    got = lora_rows(y.clone(), x, A.reshape(s * r, k), B.transpose(1, 2).reshape(s * r, n).contiguous(), offsets,
                    ranks)
    assert_close(got, expected, dtype=dtype, k=k, depth=2)
    assert torch.equal(got[slots < 0], y[slots < 0])


def test_refusals():
    y, x, A, Bt, offsets, ranks = case("fp32", [2, 1], 32, 16, seed=1, p=40)
    good = (y, x, A, Bt, offsets, ranks)

    def call(**changes):
        args = dict(zip(("y", "x", "A", "Bt", "offsets", "ranks"), good, strict=True)) | changes
        lora_rows(*args.values())

    with pytest.raises(RuntimeError, match="share one dtype"):
        call(A=A.bfloat16())
    with pytest.raises(RuntimeError, match="grain must be positive"):
        lora_rows(*good, 0)
    with pytest.raises(RuntimeError, match=r"prefetch is 0 \(off\), 1 \(burst\) or 2 \(paced\), got 3"):
        lora_rows(*good, 1, 3)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        call(y=y.double(), x=x.double(), A=A.double(), Bt=Bt.double())
    with pytest.raises(RuntimeError, match=r"A must be \[P, 32\]"):
        call(A=A[:, :31].contiguous())
    with pytest.raises(RuntimeError, match="contiguous int32"):
        call(offsets=offsets.long())
    with pytest.raises(RuntimeError, match="contiguous"):
        call(A=torch.randn(32, 40).t())
    with pytest.raises(RuntimeError, match=r"row 0 reads arena rows \[39, 42\) of 40"):
        call(offsets=torch.tensor([39, 0, 0], dtype=torch.int32), ranks=torch.tensor([3, 1, 0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="row 1 has rank -1"):
        call(ranks=torch.tensor([1, -1, 0], dtype=torch.int32))


@pytest.mark.parametrize("kind", DTYPES)
def test_time_reading_times_every_grain_then_both_prefetches(kind):
    seconds = time_reading(64, DTYPES[kind])
    assert set(seconds) == set(GRAINS) and all(0 < s < 1 for s in seconds.values())
    seconds = time_reading(64, DTYPES[kind], GRAINS["fine"], 2**20)
    assert set(seconds) == set(PREFETCH) and all(0 < s < 1 for s in seconds.values())


def test_the_largest_cache_is_read_from_sysfs(tmp_path):
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "32M")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert last_level_cache(tmp_path) == 32 << 20
    assert last_level_cache(tmp_path / "none") == 0
