"""Weight-only int8 (model/quantization.py): each many-row matmul vs its dequantized torch reference,
their choice per shape at load (model/matmul_choice.py, choose_int8_gemm), the model and the runner (each
matmul pinned) vs transformers running the same dequantized weights, and refusals."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from services.common import plan as execution
from services.common.plan import ExecutionPlan
from services.decoder.engine.step import StepInput
from services.decoder.kernels import widen_gemm_cpu
from services.decoder.model import load_model, matmul_choice, quantization
from services.decoder.model.linear import Linear, quantize_linears
from services.decoder.model.matmul_choice import choose_int8_gemm
from services.decoder.model.quantization import GEMMS, MODES, dequantize, eligible, int8_linear_ref, quantize
from services.decoder.runner import Runner
from services.decoder.server.config import QUANTIZATION_MODES
from tests.decoder.model.checkpoints import TINY_INT8_SHAPE, TINY_SHAPE, build, load_reference
from tests.decoder.model.test_model import causal_attention
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close, is_close

pytestmark = pytest.mark.numerics

CASES = ["llama_mha_untied", "llama_gqa4_tied_sharded", "qwen3_odd3_gqa3_qknorm"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build(root, name, seed=30 + i) for i, name in enumerate(CASES)}


def dequantized_reference(folder):
    """transformers' model with every Linear's weight replaced by what the int8 path computes with."""
    ref = load_reference(folder)
    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, nn.Linear):
                module.weight = nn.Parameter(dequantize(*quantize(module.weight)))
    return ref


def test_quantize_rounds_each_row_to_its_own_scale():
    w = torch.randn(33, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 33)[:, None]
    w[5] = 0
    q, scale = quantize(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127 and q.shape == w.shape and scale.shape == (33,)
    assert float(scale[5]) == 1.0 and not q[5].any()            # a zero row stays exactly zero
    # round-to-nearest against each row's scale: at most half a step off (the scale is what it multiplies by)
    err = (w - dequantize(q, scale)).abs()
    assert bool((err <= scale.float()[:, None] / 2 * (1 + 1e-6)).all())
    assert bool((q.abs().amax(1)[torch.arange(33) != 5] >= 126).all())   # each row uses its range


def test_every_matmul_is_a_candidate_of_the_plan():
    assert tuple(GEMMS) == execution.PATHS["int8_gemm"] and "int8_gemm" in execution.DECODER


@pytest.fixture
def int_mm_exact(monkeypatch):
    """The choice's logic with every candidate, whatever this dispatch's torch._int_mm computes and whether this
    CPU runs the tiles and amx kernels (the exclusions: test_dynamic_is_left_out_where_int_mm_is_not_exact,
    test_tiles_are_left_out_where_the_kernel_does_not_run)."""
    monkeypatch.setattr(quantization, "int_mm_exact", lambda: True)
    monkeypatch.setattr(widen_gemm_cpu, "available", lambda dtype: True)
    monkeypatch.setattr(widen_gemm_cpu, "amx", lambda: True)

@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,out,k,bias", [(1, 160, 64, False), (3, 7, 48, True), (17, 96, 576, False),
                                             (64, 33, 32, True), (130, 1000, 576, True), (33, 200, 1552, False)])
def test_int8_matmuls_match_dequantized_reference(gemm, dtype, rows, out, k, bias):
    if why := quantization.unusable(gemm, dtype):
        pytest.skip(f"the load-time choice leaves {gemm} out here ({why}; test_dynamic_is_left_out_where_int_mm_is_"
                    "not_exact, tests/decoder/kernels/test_widen_gemm_cpu.py)")
    g = torch.Generator().manual_seed(rows * k)
    w, x = torch.randn(out, k, generator=g), torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    q, scale = quantize(w)
    y = GEMMS[gemm](x, q, scale, b)
    assert y.dtype == dtype and y.shape == (rows, out)
    # int8pack and dequant: bf16 activations and output around fp32 sums of length k; dynamic's activations
    # lose less than bf16 rounding (quantization.dynamic_linear) and its sums are exact.
    assert_close(y, int8_linear_ref(x, q, scale, b), dtype=torch.bfloat16, k=k, what=gemm)


def test_dequant_tiles_cover_every_row(monkeypatch):
    """Many tiles and a short last one (1000 = 15 x 64 + 40 rows at the smallest tile)."""
    monkeypatch.setattr(quantization, "TILE_BYTES", 1)
    assert quantization.tile_rows(576) == quantization.TILE_ROWS
    g = torch.Generator().manual_seed(5)
    q, scale = quantize(torch.randn(1000, 576, generator=g))
    x = torch.randn(9, 576, generator=g)
    assert_close(quantization.dequant_linear(x, q, scale, None), int8_linear_ref(x, q, scale, None),
                 dtype=torch.bfloat16, k=576)


def test_dynamic_loses_less_than_bf16_rounding():
    """Through an identity weight the output is the activations as dynamic splits them: within
    max|row| / 64516 of x (bf16 rounding is max|x| / 512 of each value)."""
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9)) * torch.logspace(-4, 2, 5)[:, None]
    x[2] = 0
    y = quantization.dynamic_linear(x, torch.eye(64, dtype=torch.int8), torch.ones(64), None)
    bound = x.abs().amax(dim=1, keepdim=True) / 64516 * (1 + 1e-5)
    assert bool(((y - x).abs() <= bound).all()) and not y[2].any()
    assert float((y - x).abs().max()) < float((x.bfloat16().float() - x).abs().max()) / 10


def int8_model() -> nn.Sequential:
    """Two int8 weights of one shape, one of another (with a bias), one dense (in_features 13)."""
    model = nn.Sequential(Linear(64, 96, bias=False), Linear(64, 96, bias=False), Linear(96, 64), Linear(13, 8))
    quantize_linears(model, "int8")
    return model


def timer_of(ms: dict[tuple[int, int], dict[str, float]], calls: list):
    """An Int8GemmTimer: ms[(out, rows)] = {matmul: milliseconds per call}."""
    def timer(m, rows):
        calls.append((m.out_features, rows))
        return {name: t * 1e-3 for name, t in ms[(m.out_features, rows)].items()}
    return timer


def timings(at32: tuple[float, ...], at128: tuple[float, ...]) -> dict[int, dict[str, float]]:
    """Milliseconds per GEMMS name at 32 and 128 rows; tiles and amx, when not given, far the slowest."""
    return {32: dict(zip(GEMMS, (*at32, 99.0, 99.0)[:len(GEMMS)], strict=True)),
            128: dict(zip(GEMMS, (*at128, 99.0, 99.0)[:len(GEMMS)], strict=True))}


@pytest.mark.parametrize("at96,at64,expected", [
    # dequant the least per row summed over both counts; dynamic faster at 128 rows only, by less
    (timings((1.0, 0.5, 0.9), (4.0, 2.0, 1.9)), timings((1.0, 1.0, 1.0), (4.0, 4.0, 4.0)), ("dequant", "int8pack")),
    # dynamic wins on the first shape; on the second int8pack stays within the tie rule
    (timings((1.0, 0.9, 0.3), (4.0, 3.0, 1.0)), timings((1.0, 0.97, 2.0), (4.0, 3.9, 9.0)), ("dynamic", "int8pack")),
    # int8pack fastest on one shape, dequant (by more than the tie) on the other
    (timings((0.5, 1.0, 1.0), (2.0, 4.0, 4.0)), timings((1.0, 0.5, 2.0), (4.0, 2.0, 9.0)), ("int8pack", "dequant")),
    # tiles the least per row on one shape; on the other dequant, tiles faster at 32 rows only
    (timings((1.0, 0.5, 0.9, 0.3), (4.0, 2.0, 1.9, 1.2)), timings((1.0, 0.5, 2.0, 0.45), (4.0, 2.0, 9.0, 3.0)),
     ("tiles", "dequant")),
    # the tile unit the least per row on one shape, tiles on the other
    (timings((1.0, 0.5, 0.9, 0.3, 0.1), (4.0, 2.0, 1.9, 1.2, 0.4)),
     timings((1.0, 0.5, 2.0, 0.3, 0.4), (4.0, 2.0, 9.0, 1.2, 1.3)), ("amx", "tiles")),
])
def test_the_matmul_follows_the_timings_per_shape(at96, at64, expected, int_mm_exact):
    model, record, calls = int8_model(), ExecutionPlan(), []
    ms = {(96, r): t for r, t in at96.items()} | {(64, r): t for r, t in at64.items()}
    summary = choose_int8_gemm(model, record, timer_of(ms, calls))
    assert [m.int8_gemm for m in model[:3]] == [expected[0], expected[0], expected[1]]
    # One module per shape, at each row count, in each pass; the dense Linear is not timed.
    assert calls == [(96, 32), (96, 128), (64, 32), (64, 128)] * matmul_choice.INT8_GEMM_PASSES
    for shape, want, got in (("96x64", expected[0], at96), ("64x96+b", expected[1], at64)):
        choice = record.get(f"int8_gemm {shape}")
        assert choice.chosen == want and choice.reason == "timed, whole weight"
        assert [(t.rows, t.candidate, t.seconds) for t in choice.timings] == [
            (r, name, got[r][name] * 1e-3) for r in matmul_choice.INT8_GEMM_ROWS for name in GEMMS]
    parts = {expected[0]: ["96x64"]}
    parts.setdefault(expected[1], []).append("64x96+b")
    assert summary == "int8 gemm: " + "; ".join(f"{k} on {','.join(v)}" for k, v in parts.items())


def test_a_burst_of_load_in_one_pass_does_not_decide():
    seen = []

    def timer(m, rows):
        seen.append((m.out_features, rows))
        burst = 40.0 if len(seen) <= 2 else 1.0          # the first pass over 96x64, both row counts
        return {"int8pack": 1e-3 * rows, "dequant": 0.5e-3 * rows * burst, "dynamic": 0.9e-3 * rows}
    model, record = int8_model(), ExecutionPlan()
    choose_int8_gemm(model, record, timer)
    assert record.chosen("int8_gemm 96x64") == record.chosen("int8_gemm 64x96+b") == "dequant"
    assert {t.seconds for t in record.get("int8_gemm 96x64").timings if t.candidate == "dequant"} == {16e-3, 64e-3}


@pytest.mark.parametrize("gemm", GEMMS)
def test_a_pinned_matmul_is_not_timed(gemm, int_mm_exact):
    model, record = int8_model(), ExecutionPlan(f"int8_gemm={gemm}", execution.DECODER)
    summary = choose_int8_gemm(model, record, lambda *a: pytest.fail("nothing is timed when pinned"))
    assert [m.int8_gemm for m in model[:3]] == [gemm] * 3 and summary.startswith(f"int8 gemm: {gemm} on every")
    assert (record.chosen("int8_gemm"), record.get("int8_gemm").reason) == (gemm, f"pinned by --fast-paths "
                                                                              f"int8_gemm={gemm}")


def test_the_real_timer_times_every_usable_matmul_on_a_slice_of_a_tall_weight(monkeypatch):
    """The real kernels, so only those this CPU and dispatch run (the exclusions are tested above)."""
    monkeypatch.setattr(matmul_choice, "INT8_GEMM_OUT", 64)
    model, record = int8_model(), ExecutionPlan()
    choose_int8_gemm(model, record)
    choice = record.get("int8_gemm 96x64")
    usable = quantization.usable_gemms(torch.float32)
    assert choice.reason == "timed, first 64 of 96 rows" and choice.chosen in usable
    rows = matmul_choice.INT8_GEMM_ROWS
    assert {(t.rows, t.candidate) for t in choice.timings} == {(r, g) for r in rows for g in usable}
    assert all(t.seconds > 0 for t in choice.timings)


def test_no_int8_weights_no_choice():
    record = ExecutionPlan()
    assert choose_int8_gemm(nn.Sequential(Linear(32, 8)), record) == "int8 gemm: none (no int8 weights)"
    assert record.choices == []


def test_modes_agree_with_the_torch_free_config():
    assert MODES == QUANTIZATION_MODES


def test_ineligible_widths_stay_dense():
    assert eligible(torch.zeros(4, 32)) and not eligible(torch.zeros(4, 13)) and not eligible(torch.zeros(4, 24))
    model = nn.Sequential(Linear(32, 8), Linear(13, 8))
    assert quantize_linears(model, "int8") == "int8: 1 of 2 linears; 1 dense (in_features not a multiple of 16)"
    assert model[0].qweight is not None and model[0].weight.numel() == 0
    assert model[1].qweight is None and model[1].weight.shape == (8, 13)
    with pytest.raises(ValueError, match="choose from none, int8, int4"):
        quantize_linears(model, "int3")


@pytest.fixture
def fp32_activations(monkeypatch):
    """The kernel's fp32-activation form: then the only difference from the dequantized reference
    is fp32 accumulation order, and a comparison at fp32's bound sees every weight the int8 path
    holds (bf16 activations would add an error about as large as int8's own)."""
    monkeypatch.setattr(quantization, "ACT_DTYPE", torch.float32)


@pytest.mark.parametrize("name", CASES)
def test_model_matches_transformers_on_dequantized_weights(folders, name, fp32_activations):
    ours, ref = load_model(folders[name], "fp32"), dequantized_reference(folders[name])
    dense = load_model(folders[name], "fp32")
    summary = quantize_linears(ours, "int8")
    linears = [m for m in ours.modules() if isinstance(m, Linear)]
    assert summary == f"int8: {len(linears)} of {len(linears)} linears"
    tied = ours.config.tie_word_embeddings
    # Released dense weights, except the tied LM head's: it is the embedding table.
    assert (ours.lm_head.weight.numel() > 0) == tied
    assert ours.model.layers[0].mlp.up_proj.weight.numel() == 0
    ids = torch.randint(0, ours.config.vocab_size, (21,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = ours.logits(ours(ours.embed(ids), torch.arange(21), causal_attention))
        expected = ref(ids[None]).logits[0]
        unquantized = dense.logits(dense(dense.embed(ids), torch.arange(21), causal_attention))
    assert_close(logits, expected, **TINY_SHAPE)
    # The int8 weights really run: the unquantized model is far outside that bound.
    assert not is_close(logits, unquantized, **TINY_SHAPE)


@pytest.mark.parametrize("pins", ["", *(f"gemv=off,int8_gemm={g}" for g in GEMMS)])
def test_runner_decodes_with_int8_weights(folders, pins):
    """The real paths against the dequantized model: timed (pins ""), and each many-row matmul pinned for
    every step (the few-row kernel off). The prefill's library matmuls round the activations to bf16
    (dynamic: to int8 per row), the decode steps' few-row kernel to int8 blocks (gemv_cpu.round_blocks),
    whose bound (int8 in tests/tolerance.py) is the widest. The kernel alone is held to fp32's bound
    against the same rounding in tests/decoder/kernels/test_gemv_cpu.py."""
    if "int8_gemm=" in pins and (why := quantization.unusable(pins.rsplit("=", 1)[1], torch.float32)):
        pytest.skip(f"{pins} is refused at load here: {why}")
    name = "llama_gqa4_tied_sharded"
    runner = Runner.from_folder(folders[name], "fp32", block_size=4, num_blocks=32, quantization="int8",
                                fast_paths=pins)
    assert runner.quantization.startswith("int8: ")
    assert (runner.plan.chosen("linear"), runner.plan.get("linear").reason) == ("none", "every linear is quantized")
    int8 = [m for m in runner.model.modules() if isinstance(m, Linear) and m.qweight is not None]
    if pins:
        assert runner.plan.chosen("int8_gemm") == pins.rsplit("=", 1)[1]
        assert {(m.int8_gemm, m.gemv_rows) for m in int8} == {(pins.rsplit("=", 1)[1], 0)}
    else:
        assert any(c.name.startswith("gemv ") for c in runner.plan.choices)
        assert all(runner.plan.chosen(f"int8_gemm {m.out_features}x{m.in_features}") == m.int8_gemm for m in int8)
    ref = dequantized_reference(folders[name])
    alloc, seq = BlockAllocator(32), Seq("a", [7, 9, 11, 13, 40, 41, 42, 100, 101, 150, 5])
    runner.logits(StepInput([seq.chunk(6, alloc, 4)]))
    for _ in range(4):
        logits, _ = runner.logits(StepInput([seq.chunk(len(seq.tokens) - seq.computed, alloc, 4)]))
        with torch.no_grad():
            expected = ref(torch.tensor([seq.tokens])).logits[0, -1]
        assert_close(logits[0], expected, dtype=torch.int8, **TINY_INT8_SHAPE)
        seq.tokens.append(int(logits[0].argmax()))


def test_quantization_is_cpu_only():
    with pytest.raises(ValueError, match="runs on CPU only \\(the weights are on meta\\)"):
        quantize_linears(nn.Sequential(Linear(32, 8, device="meta")), "int8")


def test_tiles_are_left_out_where_the_kernel_does_not_run(monkeypatch):
    monkeypatch.setattr(widen_gemm_cpu, "available", lambda dtype: False)
    monkeypatch.setattr(widen_gemm_cpu, "amx", lambda: False)
    model = nn.Sequential(Linear(64, 96))
    quantize_linears(model, "int8")
    record = ExecutionPlan()
    choose_int8_gemm(model, record, lambda m, rows: {"int8pack": 1.0, "dequant": 0.9, "dynamic": 1.0, "tiles": 0.01,
                                                     "amx": 0.01})
    assert model[0].int8_gemm == "dequant"
    with pytest.raises(ValueError, match="int8_gemm=tiles: this CPU or build has no widen_gemm_cpu kernel"):
        choose_int8_gemm(model, ExecutionPlan("int8_gemm=tiles", execution.DECODER))
    with pytest.raises(ValueError, match="int8_gemm=amx: this CPU, build or kernel has no tile unit"):
        choose_int8_gemm(model, ExecutionPlan("int8_gemm=amx", execution.DECODER))


def test_dynamic_is_left_out_where_int_mm_is_not_exact(monkeypatch):
    """Where torch._int_mm saturates (AVX2 without VNNI), auto never picks dynamic however fast it times,
    and a pin of it is refused in one line."""
    monkeypatch.setattr(quantization, "int_mm_exact", lambda: False)
    model = nn.Sequential(Linear(64, 96))
    quantize_linears(model, "int8")
    record = ExecutionPlan()
    choose_int8_gemm(model, record, lambda m, rows: {"int8pack": 1.0, "dequant": 0.9, "dynamic": 0.01})
    assert model[0].int8_gemm == "dequant"
    with pytest.raises(ValueError, match="int8_gemm=dynamic: torch._int_mm"):
        choose_int8_gemm(model, ExecutionPlan("int8_gemm=dynamic", execution.DECODER))
