"""Granite 3 and OLMo 2 (model/granite.py, model/olmo2.py) vs transformers through the runner and the engine.

Each family runs with the fast paths pinned on and pinned off: the paths that compute its math serve it,
and the ones that do not (the C++ decode stack for both, the argmax screen for Granite's scaled logits,
the C++ RMSNorm for OLMo 2's rounding) are refused with the reason in the execution plan.
"""
from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.engine.step import SamplingParams, StepInput
from services.decoder.model import ModelConfig, load_model
from services.decoder.model.config import FAMILIES, VISION_LANGUAGE
from services.decoder.model.families import MODELS
from services.decoder.model.granite import Granite
from services.decoder.model.olmo2 import Olmo2
from services.decoder.runner import Runner
from tests.decoder.families.engine_parity import (
    check_chunks_preemption_and_n,
    check_chunks_then_decode,
    check_int8_decode,
    check_prefix_hit,
)
from tests.decoder.model.checkpoints import TINY_SHAPE, build, greedy_reference, load_reference
from tests.decoder.model.test_model import causal_attention
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close, is_close

pytestmark = pytest.mark.numerics

BLOCK = 4
CASES = {"granite": "granite_gqa2_multipliers", "olmo2": "olmo2_gqa4_postnorm"}
# Pinned on: every path at its fast candidate except the decode stack, which is timed (auto): pinned on it
# refuses both families outright (test_decode_stack_pinned_on_is_refused). Pinned off: every reference path.
PLANS = {
    "fast": "gemv=on,glue=cpp,attention=cpp,screen=on,grammar_mask=xgrammar",
    "reference": "linear=plain,gemv=off,glue=torch,attention=torch,decode_stack=off,screen=off,"
                 "grammar_mask=unpacked,huge_pages=off",
    "packed": "linear=packed,gemv=off,attention=cpp",
}
# What each family's plan must say it does not run, and why (CausalLM.unsupported).
REFUSED = {
    "granite": {"decode_stack": "granite's embedding, residual and attention multipliers",
                "screen": "granite divides the logits by logits_scaling"},
    "olmo2": {"decode_stack": "olmo2's post-norm blocks", "glue.norm": "olmo2's RMSNorm rounds after its weight"},
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 77, 21, 8], [40, 41], list(range(10, 33)), [7] * 13, [99, 3, 150, 12, 64]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: build(root, name, seed=60 + i) for i, (family, name) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def references(folders):
    return {family: load_reference(folder) for family, folder in folders.items()}


@pytest.fixture(scope="module")
def expected(folders):
    return {family: greedy_reference(folder, PROMPTS, GREEDY.max_tokens) for family, folder in folders.items()}


def prompt(n: int, seed: int) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(4, 160) for _ in range(n)]


def test_registry_names_every_family_the_config_accepts():
    assert set(MODELS) == set(FAMILIES)
    assert MODELS["granite"] is Granite and MODELS["olmo2"] is Olmo2


def test_config_reads_the_family_keys(folders):
    g = ModelConfig.from_folder(folders["granite"])
    assert (g.family, g.embedding_multiplier, g.residual_multiplier, g.attention_scale, g.logits_scaling) == \
        ("granite", 3.0, 0.4, 0.07, 1.5)
    assert g.qkv_bias and g.o_bias and g.mlp_bias and g.tie_word_embeddings and not g.qk_norm
    o = ModelConfig.from_folder(folders["olmo2"])
    assert (o.family, o.num_heads, o.num_kv_heads, o.head_dim) == ("olmo2", 8, 2, 8)
    assert o.qkv_bias and o.o_bias and not o.mlp_bias and o.attention_scale is None and o.logits_scaling == 1.0
    assert isinstance(load_model(folders["granite"]), Granite) and isinstance(load_model(folders["olmo2"]), Olmo2)


def _rewrite(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_bad_multipliers_and_unknown_families_are_refused_in_one_line(folders, tmp_path):
    for i, (key, value) in enumerate([("logits_scaling", 0), ("attention_multiplier", "big"),
                                      ("residual_multiplier", True)]):
        with pytest.raises(InvalidArgument, match=f"granite config key {key} must be a positive number"):
            load_model(_rewrite(folders["granite"], tmp_path / str(i), **{key: value}))
    with pytest.raises(Unsupported, match="model_type 'olmo3' is not supported"):
        load_model(_rewrite(folders["olmo2"], tmp_path / "olmo3", model_type="olmo3"))


def per_head(norm, heads: int):
    """norm's forward over each head of its [N, heads * D] input instead of the whole row."""
    def forward(x):
        h = x.float().view(x.shape[0], heads, -1)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
        return (norm.weight * h.view(x.shape)).to(x.dtype)
    return forward


@pytest.mark.parametrize("family", CASES)
def test_each_family_piece_matters(folders, family):
    """Each multiplier, the post-norms and the whole-projection q/k norms change the logits beyond rounding:
    the parity tests below would see any of them dropped."""
    folder = folders[family]
    ids = torch.randint(4, 160, (17,), generator=torch.Generator().manual_seed(2))

    def logits(model):
        with torch.no_grad():
            return model.logits(model(model.embed(ids), torch.arange(17), causal_attention))

    base = logits(load_model(folder))
    variants = []
    if family == "granite":
        for field in ("embedding_multiplier", "residual_multiplier", "attention_scale", "logits_scaling"):
            model = load_model(folder)
            model.config = dataclasses.replace(model.config, **{field: 1.0})
            for layer in model.model.layers:
                layer.residual_multiplier = model.config.residual_multiplier
                layer.self_attn.scale = model.config.attention_scale
            variants.append((field, logits(model)))
    else:
        for part in ("post_attention_layernorm", "post_feedforward_layernorm"):
            model = load_model(folder)
            for layer in model.model.layers:
                layer.get_submodule(part).weight.data.fill_(1.0)
            variants.append((part, logits(model)))
        model = load_model(folder)         # q/k normalised per head (Qwen3's way) with the same weights
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_norm.forward = per_head(attn.q_norm, attn.num_heads)
            attn.k_norm.forward = per_head(attn.k_norm, attn.num_kv_heads)
        variants.append(("per-head q/k norms", logits(model)))
    for what, other in variants:
        assert not is_close(other, base, **TINY_SHAPE), what


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("family", CASES)
def test_chunked_prefill_then_decode_matches_transformers(folders, references, family, plan):
    runner = Runner.from_folder(folders[family], "fp32", block_size=BLOCK, num_blocks=64, fast_paths=PLANS[plan])
    if plan != "reference":
        for path, why in REFUSED[family].items():
            choice = runner.plan.get(path)
            assert choice.chosen in ("off", "torch") and why in choice.reason, (path, choice)
    assert runner.fused_decode is None
    if family == "olmo2" and plan == "fast":          # glue pinned on: its SiLU*up runs, its norm does not
        assert runner.plan.chosen("glue.act") == "cpp" and runner.model.model.layers[0].mlp.native
    if family == "granite" and plan == "fast":        # a Granite RMSNorm is Llama's: the C++ norm serves it
        assert runner.plan.chosen("glue.norm") == "cpp" and runner.model.model.norm.native
    check_chunks_then_decode(runner, references[family], prompt(23, 1))


@pytest.mark.parametrize("family", CASES)
def test_decode_stack_pinned_on_is_refused_with_the_reason(folders, family):
    with pytest.raises(ValueError, match="decode_stack=on: the decode stack cannot run here .*" +
                       REFUSED[family]["decode_stack"]):
        Runner.from_folder(folders[family], "fp32", block_size=BLOCK, num_blocks=16,
                           fast_paths="attention=cpp,decode_stack=on")


def test_granite_without_logit_scaling_keeps_the_screen(folders, tmp_path):
    """The screen's refusal is Granite's divided logits, not Granite itself."""
    folder = _rewrite(folders["granite"], tmp_path / "unscaled", logits_scaling=1.0)
    runner = Runner.from_folder(folder, "fp32", block_size=BLOCK, num_blocks=16, fast_paths="screen=on")
    assert runner.screen is not None and runner.plan.chosen("screen") == "on"


@pytest.mark.parametrize("family", CASES)
def test_bf16_runner_tracks_fp32(folders, references, family):
    runner = Runner.from_folder(folders[family], "bf16", block_size=BLOCK, num_blocks=32)
    assert runner.cache.k[0].dtype == torch.bfloat16
    alloc, seq = BlockAllocator(32), Seq("a", prompt(13, 4))
    runner.logits(StepInput([seq.chunk(6, alloc, BLOCK)]))
    logits, _ = runner.logits(StepInput([seq.chunk(7, alloc, BLOCK)]))
    with torch.no_grad():
        want = references[family](torch.tensor([seq.tokens])).logits[0, -1]
    assert_close(logits[0], want, dtype=torch.bfloat16, **TINY_SHAPE)
    assert int(logits[0].argmax()) == int(want.argmax())


@pytest.mark.parametrize("family", CASES)
def test_int8_runner_matches_the_dequantized_reference(folders, family):
    check_int8_decode(folders[family])


@pytest.mark.parametrize("family", CASES)
def test_engine_equals_transformers_through_chunks_preemption_and_n(folders, expected, family):
    check_chunks_preemption_and_n(folders[family], PROMPTS, GREEDY, expected[family],
                                  (PLANS["fast"], PLANS["reference"]))


@pytest.mark.parametrize("family", CASES)
def test_prefix_hit_same_output_and_cached_tokens(folders, expected, family):
    check_prefix_hit(folders[family], PROMPTS[2], GREEDY, expected[family][2])


def test_models_doc_lists_every_family():
    """docs/models.md's table of decoder families names exactly the model types the decoder accepts."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "models.md").read_text()
    section = text.split("## Decoder families", 1)[1].split("\n## ", 1)[0]
    header, *rows = [line.split("|")[1].strip().strip("`") for line in section.splitlines() if line.startswith("| `")]
    assert header == "model_type"
    rows = set(rows)
    assert rows == set(FAMILIES) | set(VISION_LANGUAGE)
