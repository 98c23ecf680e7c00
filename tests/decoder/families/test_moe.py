"""Qwen3-MoE, Qwen2-MoE and Mixtral (model/moe_decoder.py) vs transformers through the runner and the engine.

Tiny random checkpoints with 8 experts top-2 (tests/decoder/model/checkpoints.py): Qwen3-MoE with
norm_topk_prob and a dense middle layer (mlp_only_layers), Qwen2-MoE with its sigmoid-gated shared expert
(tied), Mixtral with GQA 4 (sharded, so one expert's projections lie in several files). Each runs with the
fast paths pinned on and pinned off; the C++ decode stack, which computes a dense MLP, is refused with the
reason in the execution plan. The expert path itself is tested in tests/decoder/model/test_moe_experts.py.
"""
from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch
from torch import nn

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.engine.step import SamplingParams, StepInput
from services.decoder.kernels import gemv_cpu
from services.decoder.model import ModelConfig, load_model
from services.decoder.model.families import MODELS
from services.decoder.model.layers import MLP
from services.decoder.model.moe import Experts
from services.decoder.model.moe_decoder import MoeCausalLM, SparseMoeBlock
from services.decoder.model.quantization import dequantize, quantize
from services.decoder.runner import Runner
from tests.decoder.families.engine_parity import check_chunks_preemption_and_n, check_prefix_hit
from tests.decoder.families.routing import force_routing, reference_routing
from tests.decoder.model.checkpoints import build, greedy_reference, load_reference
from tests.decoder.model.test_model import causal_attention
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close, is_close, rel_tol

pytestmark = pytest.mark.numerics

BLOCK = 4
CASES = {"qwen3_moe": "qwen3_moe_8x2_dense_mid", "qwen2_moe": "qwen2_moe_8x2_shared", "mixtral": "mixtral_8x2_gqa4"}
# Up to 3 layers + the head; the longest dot product is the dense MLP's 96 (tests/tolerance.py).
SHAPE = {"k": 128, "depth": 4}
PLANS = {
    "fast": "gemv=on,glue=cpp,attention=cpp,screen=on,grammar_mask=xgrammar",
    "reference": "linear=plain,gemv=off,glue=torch,attention=torch,decode_stack=off,screen=off,"
                 "grammar_mask=unpacked,huge_pages=off",
    "packed": "linear=packed,gemv=off,attention=cpp",
}
REFUSED = "mixture-of-experts layers are not the C++ decode stack's dense MLP"
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 77, 21, 8], [40, 41], list(range(10, 33)), [7] * 13, [99, 3, 150, 12, 64]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {family: build(root, name, seed=80 + i) for i, (family, name) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def references(folders):
    return {family: load_reference(folder) for family, folder in folders.items()}


@pytest.fixture(scope="module")
def expected(folders):
    return {family: greedy_reference(folder, PROMPTS, GREEDY.max_tokens) for family, folder in folders.items()}


def prompt(n: int, seed: int) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(4, 160) for _ in range(n)]


def _rewrite(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_registry_and_config(folders):
    assert all(MODELS[f] is MoeCausalLM for f in CASES)
    q3 = ModelConfig.from_folder(folders["qwen3_moe"]).moe
    assert (q3.num_experts, q3.top_k, q3.expert_size, q3.norm_topk, q3.weights_fp32, q3.shared_expert_size) == \
        (8, 2, 32, True, False, 0)
    assert q3.sparse_layers == (True, False, True)
    q2 = ModelConfig.from_folder(folders["qwen2_moe"])
    assert q2.qkv_bias and not q2.o_bias and not q2.qk_norm and q2.tie_word_embeddings
    assert (q2.moe.norm_topk, q2.moe.shared_expert_size, q2.moe.sparse_layers) == (False, 48, (True, True))
    mx = ModelConfig.from_folder(folders["mixtral"])
    assert (mx.moe.num_experts, mx.moe.expert_size, mx.moe.norm_topk, mx.moe.weights_fp32) == (8, 48, True, True)
    assert (mx.num_heads, mx.num_kv_heads) == (8, 2) and not mx.qkv_bias and not mx.qk_norm
    model = load_model(folders["qwen3_moe"])
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [SparseMoeBlock, MLP, SparseMoeBlock]
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 64)


@pytest.mark.parametrize("changes,error,message", [
    (dict(sliding_window=16), Unsupported, "config.json sliding_window .* is not supported"),
    (dict(num_local_experts=0), InvalidArgument, "num_local_experts must be a positive integer"),
    (dict(num_experts_per_tok=9), InvalidArgument, "num_experts_per_tok 9 exceeds num_local_experts 8"),
])
def test_mixtral_refusals_name_the_key(folders, tmp_path, changes, error, message):
    with pytest.raises(error, match=message):
        load_model(_rewrite(folders["mixtral"], tmp_path / "m", **changes))


def test_qwen_refusals_name_the_key(folders, tmp_path):
    with pytest.raises(InvalidArgument, match="mlp_only_layers must be a list of layer indices"):
        load_model(_rewrite(folders["qwen3_moe"], tmp_path / "a", mlp_only_layers="1"))
    with pytest.raises(InvalidArgument, match="decoder_sparse_step must be a positive integer"):
        load_model(_rewrite(folders["qwen3_moe"], tmp_path / "b", decoder_sparse_step=0))
    with pytest.raises(Unsupported, match="use_sliding_window"):
        load_model(_rewrite(folders["qwen2_moe"], tmp_path / "c", use_sliding_window=True))


def test_a_missing_expert_is_refused(folders, tmp_path):
    from safetensors.torch import load_file, save_file
    src = tmp_path / "q2"
    shutil.copytree(folders["qwen2_moe"], src)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(InvalidArgument, match="lacks 1 tensors, e.g. .*layers.1.mlp.experts.gate_up_proj"):
        load_model(src)


def test_stacked_experts_load_as_stored(folders, references, tmp_path):
    """A checkpoint that stores transformers 5's stacked experts.gate_up_proj / down_proj (not each expert
    apart) loads as it is, to the same logits."""
    from safetensors.torch import load_file, save_file
    src = tmp_path / "stacked"
    shutil.copytree(folders["qwen2_moe"], src)
    tensors = load_file(src / "model.safetensors")
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = [torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")])
                   for e in range(8)]
        tensors[p + "gate_up_proj"] = torch.stack(gate_up)
        tensors[p + "down_proj"] = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
    save_file(tensors, src / "model.safetensors")
    ids = torch.randint(4, 160, (9,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_logits(load_model(src), ids), _logits(load_model(folders["qwen2_moe"]), ids))


def _logits(model, ids):
    with torch.no_grad():
        return model.logits(model(model.embed(ids), torch.arange(len(ids)), causal_attention))


@pytest.mark.parametrize("family", CASES)
def test_logits_match_transformers_and_each_piece_matters(folders, references, family):
    """Logits equal transformers'; and the routing rule, the shared expert and the dense layer each change
    them beyond rounding, so the parity would see any of them wrong."""
    ids = torch.randint(4, 160, (19,), generator=torch.Generator().manual_seed(2))
    base = _logits(load_model(folders[family]), ids)
    with torch.no_grad():
        assert_close(base, references[family](ids[None]).logits[0], **SHAPE)
    model = load_model(folders[family])
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    for block in blocks:
        block.gate.norm_topk = not block.gate.norm_topk
    variants = [("norm_topk", _logits(model, ids))]
    if family == "qwen2_moe":
        model = load_model(folders[family])
        for layer in model.model.layers:
            layer.mlp.shared_expert = None
        variants.append(("shared expert", _logits(model, ids)))
    for what, other in variants:
        assert not is_close(other, base, **SHAPE), what


def test_the_dense_layer_is_dense(folders, references):
    """Qwen3-MoE's mlp_only_layers: the middle layer's MLP is the checkpoint's dense one."""
    ours, ref = load_model(folders["qwen3_moe"]), references["qwen3_moe"]
    assert torch.equal(ours.model.layers[1].mlp.up_proj.weight, ref.model.layers[1].mlp.up_proj.weight)
    assert torch.equal(ours.model.layers[2].mlp.experts.down_proj, ref.model.layers[2].mlp.experts.down_proj)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("family", CASES)
def test_chunked_prefill_then_decode_matches_transformers(folders, references, family, plan):
    runner = Runner.from_folder(folders[family], "fp32", block_size=BLOCK, num_blocks=64, fast_paths=PLANS[plan])
    if plan != "reference":
        choice = runner.plan.get("decode_stack")
        assert choice.chosen == "off" and REFUSED in choice.reason, choice
    assert runner.fused_decode is None
    experts = [m for m in runner.model.modules() if isinstance(m, Experts)]
    if plan == "fast":                     # the C++ SiLU*up and the few-row kernel serve the experts too
        assert runner.plan.chosen("glue.act") == "cpp" and experts and all(m.native for m in experts)
        assert all(m.gemv_rows == gemv_cpu.MAX_ROWS for m in experts)
    else:                                  # gemv=off
        assert experts and all(m.gemv_rows == 0 for m in experts)
    ref = references[family]
    alloc, seq = BlockAllocator(64), Seq("a", prompt(23, 1))
    for size in (5, 1, 9, 8):
        out = runner.execute(StepInput([seq.chunk(size, alloc, BLOCK)]))
        assert out.sampled == {} or seq.computed == 23
    produced = [out.sampled["a"].token_id]
    seq.tokens.append(produced[-1])
    for _ in range(7):
        logits, _ = runner.logits(StepInput([seq.chunk(1, alloc, BLOCK)]))
        with torch.no_grad():
            want = ref(torch.tensor([seq.tokens])).logits[0, -1]
        assert_close(logits[0], want, **SHAPE)
        produced.append(int(logits[0].argmax()))
        seq.tokens.append(produced[-1])
    with torch.no_grad():
        expected = ref.generate(torch.tensor([seq.tokens[:23]]), do_sample=False, max_new_tokens=8,
                                pad_token_id=0)[0, 23:].tolist()
    assert produced == expected


@pytest.mark.parametrize("family", CASES)
def test_decode_stack_pinned_on_is_refused_with_the_reason(folders, family):
    with pytest.raises(ValueError, match="decode_stack=on: the decode stack cannot run here .*" +
                       re.escape(f"{family}'s {REFUSED}")):
        Runner.from_folder(folders[family], "fp32", block_size=BLOCK, num_blocks=16,
                           fast_paths="attention=cpp,decode_stack=on")


@pytest.mark.parametrize("family", CASES)
def test_bf16_runner_tracks_fp32(folders, references, family):
    """bf16 computes everything in bf16, the routers' logits included, where two experts' probabilities a few
    bf16 steps apart may swap places: with these random routers they do (0.1547 against 0.1504 for a
    Qwen2-MoE token in fp32, the other way round in bf16). Such a swap is a discontinuity, not an error, so
    here every router picks the experts transformers' fp32 model picks and
    weighs them by its own bf16 rule; the rest of the bf16 path must then track fp32 within bf16's bound."""
    runner = Runner.from_folder(folders[family], "bf16", block_size=BLOCK, num_blocks=32)
    assert runner.model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    alloc, seq = BlockAllocator(32), Seq("a", prompt(13, 4))
    force_routing(runner.model, reference_routing(references[family], seq.tokens))
    runner.logits(StepInput([seq.chunk(6, alloc, BLOCK)]))
    logits, _ = runner.logits(StepInput([seq.chunk(7, alloc, BLOCK)]))
    with torch.no_grad():
        want = references[family](torch.tensor([seq.tokens])).logits[0, -1]
    assert_close(logits[0], want, dtype=torch.bfloat16, **SHAPE)
    # The same token where the reference's top two logits lie further apart than bf16's bound (for Qwen3-MoE
    # here they do not: 3.1877 against 3.1749).
    top = want.topk(2).values
    if float(top[0] - top[1]) > 2 * rel_tol(torch.bfloat16, **SHAPE) * float(want.abs().max()):
        assert int(logits[0].argmax()) == int(want.argmax())


def dequantized_reference(folder):
    """transformers' model with every Linear's and every expert's weight replaced by what the int8 path
    computes with (each expert's rows scaled apart); the routers stay as they are, as ours do."""
    ref = load_reference(folder)
    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, nn.Linear):
                module.weight = nn.Parameter(dequantize(*quantize(module.weight)))
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(module, name, None)
                if isinstance(w, nn.Parameter) and w.dim() == 3:
                    w.copy_(torch.stack([dequantize(*quantize(e)) for e in w]))
    return ref


@pytest.mark.parametrize("family", CASES)
def test_int8_runner_matches_the_dequantized_reference(folders, family):
    runner = Runner.from_folder(folders[family], "fp32", block_size=BLOCK, num_blocks=32, quantization="int8")
    sparse = sum(ModelConfig.from_folder(folders[family]).moe.sparse_layers)
    assert runner.quantization.endswith(f"; experts of {sparse} of {sparse} layers"), runner.quantization
    assert all(m.quantized for m in runner.model.modules() if isinstance(m, Experts))
    ref = dequantized_reference(folders[family])
    alloc, seq = BlockAllocator(32), Seq("a", [7, 9, 11, 13, 40, 41, 42, 100, 101, 150, 5])
    # int8 rounding swaps near-tied experts as bf16 does (test_bf16_runner_tracks_fp32): route as the reference.
    force_routing(runner.model, [r[:6] for r in reference_routing(ref, seq.tokens)])
    runner.logits(StepInput([seq.chunk(6, alloc, BLOCK)]))
    for _ in range(4):
        force_routing(runner.model, [r[seq.computed:] for r in reference_routing(ref, seq.tokens)])
        logits, _ = runner.logits(StepInput([seq.chunk(len(seq.tokens) - seq.computed, alloc, BLOCK)]))
        with torch.no_grad():
            want = ref(torch.tensor([seq.tokens])).logits[0, -1]
        assert_close(logits[0], want, dtype=torch.int8, **SHAPE)
        seq.tokens.append(int(logits[0].argmax()))


@pytest.mark.parametrize("family", CASES)
def test_engine_equals_transformers_through_chunks_preemption_and_n(folders, expected, family):
    check_chunks_preemption_and_n(folders[family], PROMPTS, GREEDY, expected[family],
                                  (PLANS["fast"], PLANS["reference"]))


@pytest.mark.parametrize("family", CASES)
def test_prefix_hit_same_output_and_cached_tokens(folders, expected, family):
    check_prefix_hit(folders[family], PROMPTS[2], GREEDY, expected[family][2])
