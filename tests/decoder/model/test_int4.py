"""`--quantization int4` (model/grouped.py through model/linear.py): each matmul path over a grouped weight
against the dequantized torch reference, pinned on and off; the per-shape choice of the many-row path; the
model and the runner against transformers running the same dequantized weights."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from services.common import plan as execution
from services.common.plan import ExecutionPlan
from services.decoder.engine.step import StepInput
from services.decoder.kernels import gemv_cpu, widen_gemm_cpu
from services.decoder.model import grouped, load_model, matmul_choice
from services.decoder.model.grouped import dequantize, grouped_linear, grouped_linear_ref, int4pack, quantize
from services.decoder.model.linear import Linear, fuse, fusible, quantize_linears
from services.decoder.model.matmul_choice import choose_gemv, choose_grouped_matmul
from services.decoder.model.quantization import INT4_GROUP
from services.decoder.runner import Runner
from tests.decoder.model.checkpoints import TINY_INT8_SHAPE, TINY_SHAPE, build, load_reference
from tests.decoder.model.test_model import causal_attention
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close, is_close

pytestmark = pytest.mark.numerics

CASES = ["llama_gqa4_tied_sharded", "qwen3_odd3_gqa3_qknorm"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build(root, name, seed=50 + i) for i, name in enumerate(CASES)}


def dequantized_reference(folder):
    """transformers' model with every Linear's weight replaced by what the int4 path computes with (those whose
    in_features a group divides: the others stay dense in ours too)."""
    ref = load_reference(folder)
    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, nn.Linear) and module.in_features % INT4_GROUP == 0:
                module.weight = nn.Parameter(dequantize(quantize(module.weight, 4, 32)))
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["dequant", "int4pack"])
@pytest.mark.parametrize("rows,out,k,bias", [(5, 32, 64, False), (17, 96, 576, True), (64, 48, 32, True)])
def test_many_row_paths_match_the_reference(dtype, path, rows, out, k, bias):
    g = torch.Generator().manual_seed(rows * k)
    gw = quantize(torch.randn(out, k, generator=g), 4, 32)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    y = grouped_linear(x, gw, b, path, int4pack(gw, dtype) if path == "int4pack" else None)
    assert y.dtype == dtype and y.shape == (rows, out)
    assert_close(y, grouped_linear_ref(x, gw, b), dtype=dtype, k=k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dequant_path_widens_a_large_weight_in_pieces(monkeypatch, dtype):
    """Pieces of 3 output rows over 8 (two whole and a remainder), with the bias sliced to match: the reference's
    result, and each piece dequantized from views of its own rows."""
    g = torch.Generator().manual_seed(8)
    gw = quantize(torch.randn(8, 64, generator=g), 4, 32)
    x, b = torch.randn(5, 64, generator=g).to(dtype), torch.randn(8, generator=g).to(dtype)
    monkeypatch.setattr(grouped, "DEQUANT_PIECE_BYTES", 3 * 64 * x.element_size())
    widened = []
    expand = grouped.expand
    monkeypatch.setattr(grouped, "expand", lambda part, to: widened.append(part.out_features) or expand(part, to))
    y = grouped_linear(x, gw, b, "dequant")
    assert widened == [3, 3, 2] and y.dtype == dtype and y.shape == (5, 8)
    assert_close(y, grouped_linear_ref(x, gw, b), dtype=dtype, k=64)
    part = gw.rows(3, 6)
    assert part.codes.data_ptr() == gw.codes[3].data_ptr() and torch.equal(dequantize(part), dequantize(gw)[3:6])


def test_int4pack_takes_only_what_torch_does():
    assert grouped.int4pack_fits(quantize(torch.randn(32, 64), 4, 32))
    for gw in (quantize(torch.randn(33, 64), 4, 32), quantize(torch.randn(32, 64), 4, 16),
               quantize(torch.randn(32, 64), 8, 32)):
        assert not grouped.int4pack_fits(gw)
        with pytest.raises(ValueError, match="does not fit torch's 4-bit kernel"):
            int4pack(gw, torch.float32)


def grouped_model() -> nn.Sequential:
    """Two 4-bit weights torch's kernel takes (one shape, one with bias), one it does not (out 40), one dense."""
    model = nn.Sequential(Linear(64, 96), Linear(96, 64, bias=False), Linear(64, 96), Linear(96, 40), Linear(40, 8))
    quantize_linears(model[:4], "int4")
    return model


@pytest.mark.parametrize("ms,expected", [
    ({"dequant": 4.0, "int4pack": 2.0, "tiles": 3.0, "amx": 3.5}, ("int4pack", "tiles")),
    ({"dequant": 2.0, "int4pack": 4.0, "tiles": 1.0, "amx": 1.5}, ("tiles", "tiles")),
    ({"dequant": 2.0, "int4pack": 3.0, "tiles": 1.0, "amx": 0.8}, ("amx", "amx")),
    ({"dequant": 2.0, "int4pack": 1.95, "tiles": 3.0, "amx": 3.0}, ("dequant", "dequant")),
])
def test_the_many_row_path_follows_the_timings(ms, expected, monkeypatch):
    """Each shape's usable paths timed at every GROUPED_ROWS count; the least summed time per row kept where it
    beats dequant. The 40-row weight does not fit torch's 4-bit kernel, so it is timed without it."""
    monkeypatch.setattr(widen_gemm_cpu, "available", lambda dtype: True)    # the timings decide, not this CPU
    monkeypatch.setattr(widen_gemm_cpu, "amx", lambda: True)
    model, record, calls = grouped_model(), ExecutionPlan(), []

    def timer(group, paths):
        calls.append((len(group), tuple(paths)))
        return {p: ms[p] * 1e-3 for p in paths}
    summary = choose_grouped_matmul(model, record, timer)
    assert [m.grouped_path for m in model[:4]] == [expected[0]] * 3 + [expected[1]]
    assert [m.int4pack is not None for m in model[:4]] == [expected[0] == "int4pack"] * 3 + [False]
    counts = len(matmul_choice.GROUPED_ROWS)
    every = ("dequant", "int4pack", "tiles", "amx")
    assert calls == [(2, every)] * counts + [(1, every)] * counts + [(1, ("dequant", "tiles", "amx"))] * counts
    assert record.chosen("grouped_matmul 96x64+b int4/g32") == expected[0]
    assert record.chosen("grouped_matmul 40x96+b int4/g32") == expected[1]
    assert summary.startswith("grouped matmul ") and "40x96" in summary


def test_a_path_far_behind_is_not_timed_at_more_rows(monkeypatch):
    monkeypatch.setattr(widen_gemm_cpu, "available", lambda dtype: True)
    monkeypatch.setattr(widen_gemm_cpu, "amx", lambda: False)
    model, calls = nn.Sequential(Linear(64, 96)), []
    quantize_linears(model, "int4")

    def timer(group, paths):
        calls.append(tuple(paths))
        return {p: {"dequant": 1.0, "int4pack": 50.0, "tiles": 2.0}[p] for p in paths}
    choose_grouped_matmul(model, ExecutionPlan(), timer)
    assert calls == [("dequant", "int4pack", "tiles"), ("dequant", "tiles")] and model[0].grouped_path == "dequant"


def test_a_shape_only_dequant_takes_is_not_timed(monkeypatch):
    monkeypatch.setattr(widen_gemm_cpu, "available", lambda dtype: False)
    monkeypatch.setattr(widen_gemm_cpu, "amx", lambda: False)
    model = nn.Sequential(Linear(96, 40))
    quantize_linears(model, "int4")
    record = ExecutionPlan()
    choose_grouped_matmul(model, record, lambda *a: pytest.fail("one path: nothing to time"))
    assert model[0].grouped_path == "dequant"
    assert record.get("grouped_matmul 40x96+b int4/g32").reason == "no other path takes this weight"


@pytest.mark.parametrize("pin", execution.PATHS["grouped_matmul"])
@pytest.mark.parametrize("gemv", execution.PATHS["gemv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_pinned_path_matches_the_reference(pin, gemv, dtype):
    """Every row count from 1 to past the few-row kernel, with each path pinned: the forward equals the path's
    own function, and that is the dequantized reference (x rounded per group on the few-row kernel)."""
    if pin == "tiles" and not widen_gemm_cpu.available(dtype) or pin == "amx" and not widen_gemm_cpu.amx():
        pytest.skip(f"this CPU has no widen_gemm_cpu {pin} kernel for {dtype} (test_widen_gemm_cpu checks where)")
    model = grouped_model().to(dtype)
    record = ExecutionPlan(f"grouped_matmul={pin},gemv={gemv}", execution.DECODER)
    choose_grouped_matmul(model, record, lambda *a: pytest.fail("nothing is timed when pinned"))
    choose_gemv(model, record, lambda *a: pytest.fail("nothing is timed when pinned"))
    m = model[1]                                          # 64 x 96 at 4 bits: torch's kernel takes it
    assert m.grouped_path == pin and m.gemv_rows == (gemv_cpu.MAX_ROWS if gemv == "on" else 0)
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 4, 5, gemv_cpu.MAX_ROWS + 1, 33):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        few = gemv == "on" and rows <= gemv_cpu.MAX_ROWS
        with torch.no_grad():
            y = m(x)
        assert torch.equal(y, grouped_linear(x, m.grouped, None, "gemv" if few else pin, m.int4pack))
        # tiles multiply fp32 x in bf16 where the CPU has the bf16 dot product (widen_gemm_cpu.products_for), amx
        # always
        products = {"tiles": widen_gemm_cpu.products_for(dtype), "amx": torch.bfloat16}
        bound = products.get(pin, dtype) if not few else dtype
        assert_close(y, grouped_linear_ref(x, m.grouped, rounded=few), dtype=bound, k=96)


def test_pinning_int4pack_needs_a_weight_it_takes():
    model = nn.Sequential(Linear(64, 40))
    quantize_linears(model, "int4")
    with pytest.raises(ValueError, match="grouped_matmul=int4pack: no grouped weight fits"):
        choose_grouped_matmul(model, ExecutionPlan("grouped_matmul=int4pack", execution.DECODER))


def test_pinning_tiles_needs_the_kernel(monkeypatch):
    model = grouped_model()
    monkeypatch.setattr(widen_gemm_cpu, "available", lambda dtype: False)
    monkeypatch.setattr(widen_gemm_cpu, "amx", lambda: False)
    with pytest.raises(ValueError, match="grouped_matmul=tiles: this CPU or build has no widen_gemm_cpu kernel"):
        choose_grouped_matmul(model, ExecutionPlan("grouped_matmul=tiles", execution.DECODER))
    with pytest.raises(ValueError, match="grouped_matmul=amx: this CPU, build or kernel has no tile unit"):
        choose_grouped_matmul(model, ExecutionPlan("grouped_matmul=amx", execution.DECODER))


@pytest.mark.parametrize("src,dst", [((4, 32), (8, 16)), ((4, 32), (4, 16)), ((8, 32), (8, 16)), ((4, 16), (8, 16)),
                                     ((8, 16), (8, 16))])
def test_regroup_holds_the_same_weights(src, dst):
    gw = quantize(torch.randn(24, 96, generator=torch.Generator().manual_seed(2)), *src)
    again = grouped.regroup(gw, *dst)
    assert (again.bits, again.group) == dst and torch.equal(dequantize(again), dequantize(gw))


def test_regroup_refuses_a_coarser_format():
    with pytest.raises(ValueError, match=r"int8/g16 cannot be held as int4/g16 exactly"):
        grouped.regroup(quantize(torch.randn(8, 64), 8, 16), 4, 16)
    with pytest.raises(ValueError, match=r"int4/g16 cannot be held as int4/g32 exactly"):
        grouped.regroup(quantize(torch.randn(8, 64), 4, 16), 4, 32)


def test_parts_in_different_formats_fuse_into_the_finest():
    """As a GGUF file's Q4_K_M stores them: q and k in 4 bits over groups of 32, v in 8 bits over groups of 16."""
    g = torch.Generator().manual_seed(6)
    parts = [Linear(64, n, bias=False) for n in (32, 16, 16)]
    for p, fmt in zip(parts, ((4, 32), (4, 32), (8, 16)), strict=True):
        p.set_grouped(quantize(torch.randn(p.out_features, 64, generator=g), *fmt))
    expected = torch.cat([dequantize(p.grouped) for p in parts])
    assert fusible(parts)
    fused = fuse(parts)
    assert fused.grouped.describe() == "int8/g16" and torch.equal(dequantize(fused.grouped), expected)
    lone = Linear(64, 8, bias=False)
    lone.set_grouped(quantize(torch.randn(8, 64, generator=g)), release=False)
    assert not fusible([Linear(64, 8, bias=False), lone])     # dense beside grouped: never


def test_quantize_linears_int4():
    model = nn.Sequential(Linear(64, 8), Linear(48, 8))
    assert quantize_linears(model, "int4") == "int4: 1 of 2 linears; 1 dense (in_features not a multiple of 32)"
    assert model[0].grouped.describe() == "int4/g32" and model[0].released
    assert model[1].grouped is None and model[1].weight.shape == (8, 48)
    with pytest.raises(ValueError, match="grouped weight 8x32 for a 8x64 linear"):
        model[0].set_grouped(quantize(torch.randn(8, 32)))


def test_fp16_activations_stay_off_the_few_row_kernel():
    """The kernel takes fp32 and bf16 activations: an fp16 model's grouped weights run the many-row path."""
    model = grouped_model().half()
    record = ExecutionPlan("grouped_matmul=dequant", execution.DECODER)
    choose_grouped_matmul(model, record, lambda *a: pytest.fail("nothing is timed when pinned"))
    assert choose_gemv(model, record, lambda *a: pytest.fail("no weight to time")) == "gemv: none (no CPU weights)"
    assert all(m.gemv_rows == 0 for m in model[:4])
    with pytest.raises(ValueError, match="gemv=on: the model has no CPU weights the few-row kernel takes"):
        choose_gemv(model, ExecutionPlan("gemv=on", execution.DECODER))
    x = torch.randn(1, 96).half()
    with torch.no_grad():
        assert_close(model[1](x), grouped_linear_ref(x, model[1].grouped), dtype=torch.float16, k=96)


def test_a_loader_sets_a_grouped_weight_on_a_meta_linear():
    """What a GGUF loader does: a Linear built on the meta device takes its grouped weight and runs on CPU."""
    m = Linear(64, 32, bias=False, device="meta", dtype=torch.bfloat16)
    gw = quantize(torch.randn(32, 64), 8, 16)
    m.set_grouped(gw)
    assert m.weight.device.type == "cpu" and m.weight.dtype == torch.bfloat16 and m.released
    x = torch.randn(6, 64).bfloat16()
    with torch.no_grad():
        assert torch.equal(m(x), grouped_linear(x, gw, None, "dequant"))


def test_model_matches_transformers_on_dequantized_weights(folders):
    """Many rows on the dequantized path in fp32: only the summation order differs from the reference."""
    name = "qwen3_odd3_gqa3_qknorm"
    ours, ref, dense = load_model(folders[name], "fp32"), dequantized_reference(folders[name]), \
        load_model(folders[name], "fp32")
    summary = quantize_linears(ours, "int4")
    assert summary.startswith("int4: ")
    ids = torch.randint(0, ours.config.vocab_size, (21,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = ours.logits(ours(ours.embed(ids), torch.arange(21), causal_attention))
        expected = ref(ids[None]).logits[0]
        unquantized = dense.logits(dense(dense.embed(ids), torch.arange(21), causal_attention))
    assert_close(logits, expected, **TINY_SHAPE)
    assert not is_close(logits, unquantized, **TINY_SHAPE)     # the 4-bit weights really run


@pytest.mark.parametrize("pins", ["grouped_matmul=dequant,gemv=on", "grouped_matmul=int4pack,gemv=off",
                                  pytest.param("grouped_matmul=tiles,gemv=off", marks=pytest.mark.skipif(
                                      not widen_gemm_cpu.available(torch.float32),
                                      reason="no widen_gemm_cpu kernel for fp32 on this CPU")),
                                  pytest.param("grouped_matmul=amx,gemv=off", marks=pytest.mark.skipif(
                                      not widen_gemm_cpu.amx(), reason="no tile unit on this CPU")), ""])
def test_runner_decodes_with_int4_weights(folders, pins):
    """The runner's real paths (prefill on the many-row path, decode steps on the few-row kernel, whose x is
    rounded to int8 per group: the int8 bound of tests/tolerance.py) against the dequantized model; greedy
    tokens follow the runner's own argmax."""
    name = "llama_gqa4_tied_sharded"
    runner = Runner.from_folder(folders[name], "fp32", block_size=4, num_blocks=32, quantization="int4",
                                fast_paths=pins)
    assert runner.quantization.startswith("int4: ")
    assert any(c.name.startswith("grouped_matmul ") for c in runner.plan.choices)
    ref = dequantized_reference(folders[name])
    alloc, seq = BlockAllocator(32), Seq("a", [7, 9, 11, 13, 40, 41, 42, 100, 101, 150, 5])
    runner.logits(StepInput([seq.chunk(6, alloc, 4)]))
    for _ in range(3):
        logits, _ = runner.logits(StepInput([seq.chunk(len(seq.tokens) - seq.computed, alloc, 4)]))
        with torch.no_grad():
            expected = ref(torch.tensor([seq.tokens])).logits[0, -1]
        assert_close(logits[0], expected, dtype=torch.int8, **TINY_INT8_SHAPE)
        seq.tokens.append(int(logits[0].argmax()))
