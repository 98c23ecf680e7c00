"""Weight-only int8 (model/quantization.py): the kernel vs its dequantized torch reference, the
model and the runner vs transformers running the same dequantized weights, and refusals."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from services.decoder.engine.step import StepInput
from services.decoder.model import load_model, quantization
from services.decoder.model.linear import Linear, quantize_linears
from services.decoder.model.quantization import MODES, dequantize, eligible, int8_linear, int8_linear_ref, quantize
from services.decoder.runner import Runner
from services.decoder.server.config import QUANTIZATION_MODES
from tests.decoder.model.checkpoints import TINY_SHAPE, build, load_reference
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,out,k,bias", [(1, 160, 64, False), (3, 7, 48, True), (17, 96, 576, False),
                                             (64, 33, 32, True)])
def test_int8_linear_matches_dequantized_reference(dtype, rows, out, k, bias):
    g = torch.Generator().manual_seed(rows * k)
    w, x = torch.randn(out, k, generator=g), torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    q, scale = quantize(w)
    y = int8_linear(x, q, scale, b)
    assert y.dtype == dtype and y.shape == (rows, out)
    # bf16 activations and output around an fp32-accumulated dot product of length k
    assert_close(y, int8_linear_ref(x, q, scale, b), dtype=torch.bfloat16, k=k)


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


def test_runner_decodes_with_int8_weights(folders):
    """The real paths against the dequantized model: the prefill's library matmuls round the activations
    to bf16, the decode steps' few-row kernel to int8 blocks (gemv_cpu.round_blocks), whose bound (int8
    in tests/tolerance.py) is the wider of the two. The kernel alone is held to fp32's bound against
    the same rounding in tests/decoder/kernels/test_gemv_cpu.py."""
    name = "llama_gqa4_tied_sharded"
    runner = Runner.from_folder(folders[name], "fp32", block_size=4, num_blocks=32, quantization="int8")
    assert runner.quantization.startswith("int8: ")
    assert (runner.plan.chosen("linear"), runner.plan.get("linear").reason) == ("none", "every linear is quantized")
    assert any(c.name.startswith("gemv ") for c in runner.plan.choices)
    ref = dequantized_reference(folders[name])
    alloc, seq = BlockAllocator(32), Seq("a", [7, 9, 11, 13, 40, 41, 42, 100, 101, 150, 5])
    runner.logits(StepInput([seq.chunk(6, alloc, 4)]))
    for _ in range(4):
        logits, _ = runner.logits(StepInput([seq.chunk(len(seq.tokens) - seq.computed, alloc, 4)]))
        with torch.no_grad():
            expected = ref(torch.tensor([seq.tokens])).logits[0, -1]
        assert_close(logits[0], expected, dtype=torch.int8, **TINY_SHAPE)
        seq.tokens.append(int(logits[0].argmax()))


def test_quantization_is_cpu_only():
    with pytest.raises(ValueError, match="runs on CPU only \\(the weights are on meta\\)"):
        quantize_linears(nn.Sequential(Linear(32, 8, device="meta")), "int8")

