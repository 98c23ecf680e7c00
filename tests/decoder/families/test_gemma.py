"""Gemma 2 and Gemma 3 text (model/gemma.py) vs transformers: config keys, logits, each piece of their math, and
exact greedy tokens through the runner and the engine with the fast paths pinned on and pinned off.

The model tests call the model directly with a test-local attention that applies what the runner's attention
applies from the config (causal, each layer's sliding window, the score soft-cap), as transformers' eager
attention does; the runner and engine tests go through the paged cache, where the windows are shorter than the
prompts and the soft-caps bite.
"""
from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma2Config, Gemma3TextConfig

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.engine.step import SamplingParams, StepInput
from services.decoder.model import ModelConfig, load_model
from services.decoder.model.families import MODELS
from services.decoder.model.gemma import Gemma2, Gemma3
from services.decoder.runner import Runner
from tests.decoder.families.engine_parity import (
    check_chunks_preemption_and_n,
    check_chunks_then_decode,
    check_int8_decode,
    check_prefix_hit,
)
from tests.decoder.model.checkpoints import TINY_SHAPE, build, greedy_reference, load_reference
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close, is_close

pytestmark = pytest.mark.numerics

CASES = {"gemma2": "gemma2_gqa2_window_softcap", "gemma3_text": "gemma3_gqa4_local_rope"}
BLOCK = 4
# Pinned on: every path at its fast candidate but the decode stack (timed; pinned on it refuses both families,
# test_decode_stack_pinned_on_is_refused_with_the_reason). Pinned off: every reference path.
PLANS = {
    "fast": "gemv=on,glue=cpp,attention=cpp,screen=on,grammar_mask=xgrammar",
    "reference": "linear=plain,gemv=off,glue=torch,attention=torch,decode_stack=off,screen=off,"
                 "grammar_mask=unpacked,huge_pages=off",
    "packed": "linear=packed,gemv=off,attention=cpp",
}
REFUSED = {
    "gemma2": {"decode_stack": "gemma2's sandwich norms, GeGLU, soft-caps and sliding windows",
               "glue.norm": "gemma2's RMSNorm scales by 1 + weight", "glue.act": "gemma2's MLP gates with the tanh",
               "screen": "gemma2 soft-caps the logits"},
    "gemma3_text": {"decode_stack": "gemma3_text's sandwich norms", "glue.norm": "gemma3_text's RMSNorm scales by",
                    "glue.act": "gemma3_text's MLP gates with the tanh GELU"},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    return {family: build(root, name, seed=80 + i) for i, (family, name) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def references(folders):
    return {family: load_reference(folder) for family, folder in folders.items()}


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 77, 21, 8], [40, 41], list(range(10, 33)), [7] * 13, [99, 3, 150, 12, 64]]


@pytest.fixture(scope="module")
def expected(folders):
    return {family: greedy_reference(folder, PROMPTS, GREEDY.max_tokens) for family, folder in folders.items()}


def prompt(n: int, seed: int) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(4, 160) for _ in range(n)]


def windowed_attention(cfg: ModelConfig):
    """One sequence, no cache, as transformers' eager attention: scores q.k * scale, soft-capped
    (cfg.attn_softcap), masked to the causal window of cfg.layer_windows[layer], softmax in fp32."""
    def attend(layer, q, k, v, scale=None):
        n, heads, d = q.shape
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
        scores = torch.einsum("nhd,mhd->hnm", q, k) * (d ** -0.5 if scale is None else scale)
        if cfg.attn_softcap is not None:
            scores = torch.tanh(scores / cfg.attn_softcap) * cfg.attn_softcap
        i = torch.arange(n)
        allowed = i[None, :] <= i[:, None]
        window = cfg.layer_windows[layer] if cfg.layer_windows else None
        if window is not None:
            allowed &= i[None, :] > i[:, None] - window
        probs = F.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("hnm,mhd->nhd", probs, v)
    return attend


def run(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(model.embed(ids), torch.arange(len(ids)), windowed_attention(model.config)))


def _rewrite(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_registry_names_both_families():
    assert MODELS["gemma2"] is Gemma2 and MODELS["gemma3_text"] is Gemma3


def test_config_reads_the_family_keys(folders):
    g2 = ModelConfig.from_folder(folders["gemma2"])
    assert (g2.family, g2.num_heads, g2.num_kv_heads, g2.head_dim) == ("gemma2", 4, 2, 16)
    assert (g2.attention_scale, g2.attn_softcap, g2.final_softcap) == (24 ** -0.5, 2.0, 4.0)
    assert g2.layer_windows == (5, None) and g2.local_rope is None and not g2.qk_norm and g2.tie_word_embeddings
    g3 = ModelConfig.from_folder(folders["gemma3_text"])
    assert (g3.attention_scale, g3.attn_softcap, g3.final_softcap) == (20 ** -0.5, None, None)
    assert g3.layer_windows == (6, None) and not g3.tie_word_embeddings
    assert (g3.rope.kind, g3.rope.theta, g3.rope.factor) == ("linear", 1e6, 4.0)
    assert (g3.local_rope.kind, g3.local_rope.theta) == ("default", 1e4)
    assert isinstance(load_model(folders["gemma2"]), Gemma2) and isinstance(load_model(folders["gemma3_text"]), Gemma3)


def _base(family: str, layers: int) -> dict:
    return dict(model_type=family, vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("layers,pattern", [(5, None), (13, None), (13, 4)])
def test_layer_types_and_rope_default_as_transformers_reads_them(layers, pattern):
    """Configs without layer_types (older Gemma 2 and 3 ones, sliding_window_pattern) and Gemma 3's older RoPE
    keys (rope_theta, rope_local_base_freq, rope_scaling) mean what transformers' configs make of them."""
    raw2 = _base("gemma2", layers)
    ours2 = ModelConfig.from_dict(raw2)
    theirs2 = Gemma2Config(**{k: v for k, v in raw2.items() if k != "model_type"})
    assert [w is not None for w in ours2.layer_windows] == [t == "sliding_attention" for t in theirs2.layer_types]
    assert set(ours2.layer_windows) == {4096, None} and ours2.attn_softcap == 50.0 and ours2.final_softcap == 30.0
    raw3 = dict(_base("gemma3_text", layers), rope_theta=500000.0, rope_local_base_freq=2000.0,
                rope_scaling={"rope_type": "linear", "factor": 8.0})
    if pattern is not None:
        raw3["sliding_window_pattern"] = pattern
    theirs = Gemma3TextConfig(**{k: v for k, v in raw3.items() if k != "model_type"})
    ours3 = ModelConfig.from_dict(raw3)
    assert [w is not None for w in ours3.layer_windows] == [t == "sliding_attention" for t in theirs.layer_types]
    full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert (ours3.rope.kind, ours3.rope.theta, ours3.rope.factor) == (full["rope_type"], full["rope_theta"], 8.0)
    assert (ours3.local_rope.kind, ours3.local_rope.theta) == (local["rope_type"], local["rope_theta"])


@pytest.mark.parametrize("family,changes,error,message", [
    ("gemma2", dict(hidden_activation="gelu"), Unsupported, "gemma2 config key hidden_activation 'gelu'"),
    ("gemma2", dict(hidden_act="silu"), Unsupported, "gemma2 config key hidden_act 'silu'"),
    ("gemma2", dict(use_bidirectional_attention=True), Unsupported, "use_bidirectional_attention"),
    ("gemma2", dict(layer_types=["chunked_attention", "full_attention"]), Unsupported,
     r"layer_types \[.chunked_attention.\] are not supported"),
    ("gemma2", dict(layer_types=["full_attention"]), InvalidArgument,
     r"layer_types must list one type per layer \(2\)"),
    ("gemma2", dict(sliding_window=0), InvalidArgument, "sliding_window must be a positive integer"),
    ("gemma2", dict(query_pre_attn_scalar=-1), InvalidArgument, "query_pre_attn_scalar must be a positive number"),
    ("gemma2", dict(final_logit_softcapping="big"), InvalidArgument, "final_logit_softcapping must be a positive"),
    ("gemma3_text", dict(attn_logit_softcapping=50.0), Unsupported, "attn_logit_softcapping is not supported"),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0}}), Unsupported,
     "rope_parameters.full_attention.rope_type 'yarn' is not supported"),
    ("gemma3_text", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), Unsupported,
     "rope_parameters must be nested by layer type"),
])
def test_keys_it_does_not_compute_are_refused_in_one_line(folders, tmp_path, family, changes, error, message):
    with pytest.raises(error, match=message) as info:
        load_model(_rewrite(folders[family], tmp_path / "changed", **changes))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("family", CASES)
def test_logits_match_transformers(folders, family):
    ours, ref = load_model(folders[family], "fp32"), load_reference(folders[family])
    for seed in (5, 6):
        ids = torch.randint(0, 160, (19,), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            expected = ref(ids[None]).logits[0]
        assert_close(run(ours, ids), expected, **TINY_SHAPE, what=f"seed {seed}")
    assert expected.std() > 0.5, "logits too flat to be a meaningful comparison"


@pytest.mark.parametrize("family", CASES)
def test_bf16_logits_track_transformers(folders, family):
    ours, ref = load_model(folders[family], "bf16"), load_reference(folders[family])
    ids = torch.randint(0, 160, (17,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    assert_close(run(ours, ids), expected, dtype=torch.bfloat16, **TINY_SHAPE)


def _variants(folder, family):
    """(what, a model computing something else) for each piece of the family's math."""
    def fresh(**config):
        model = load_model(folder)
        if config:
            model.config = dataclasses.replace(model.config, **config)
        return model

    cfg = fresh().config
    out = [("windows", fresh(layer_windows=())),
           ("final soft-cap", fresh(final_softcap=None if cfg.final_softcap else 2.0))]
    for layer in (m := fresh()).model.layers:
        layer.self_attn.scale = None
    out.append(("query_pre_attn_scalar in the layers", m))
    if cfg.attn_softcap is not None:
        out.append(("attention soft-cap", fresh(attn_softcap=None)))
    m = fresh()
    m.embed = m.model.embed_tokens.forward             # the unscaled rows
    out.append(("embedding scale", m))
    for part in ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
        m = fresh()
        for layer in m.model.layers:
            layer.get_submodule(part).weight.data.fill_(0.0)       # (1 + 0): the identity's scale
        out.append((part, m))
    m = fresh()
    for norm in [mod for mod in m.modules() if type(mod).__name__ == "GemmaRMSNorm"]:
        norm.weight.data -= 1.0                                    # scaled by w, as Llama's norm
    out.append(("1 + weight", m))
    m = fresh()
    for layer in m.model.layers:
        layer.mlp.activation = F.silu
    out.append(("tanh GELU", m))
    if family == "gemma3_text":
        m = fresh()
        m.local_rotary = m.rotary
        out.append(("local RoPE", m))
        m = fresh()
        for layer in m.model.layers:
            layer.self_attn.q_norm = layer.self_attn.k_norm = None
        out.append(("q/k norms", m))
    return out


@pytest.mark.parametrize("family", CASES)
def test_each_family_piece_matters(folders, family):
    """Dropping any piece changes the logits beyond rounding: the parity tests would see it missing."""
    ids = torch.randint(4, 160, (17,), generator=torch.Generator().manual_seed(2))
    base = run(load_model(folders[family]), ids)
    for what, model in _variants(folders[family], family):
        assert not is_close(run(model, ids), base, **TINY_SHAPE), what


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("family", CASES)
def test_chunked_prefill_then_decode_matches_transformers(folders, references, family, plan):
    runner = Runner.from_folder(folders[family], "fp32", block_size=BLOCK, num_blocks=64, fast_paths=PLANS[plan])
    assert runner.fused_decode is None
    if plan == "fast":
        for path, why in REFUSED[family].items():
            choice = runner.plan.get(path)
            assert choice.chosen in ("off", "torch") and why in choice.reason, (path, choice)
        assert not any(getattr(m, "native", False) for m in runner.model.modules())
        # Gemma 3 without a final soft-cap keeps the argmax screen (its logits are the head's).
        assert (runner.screen is not None) == (family == "gemma3_text")
    check_chunks_then_decode(runner, references[family], prompt(23, 1))


@pytest.mark.parametrize("family", CASES)
def test_decode_stack_pinned_on_is_refused_with_the_reason(folders, family):
    with pytest.raises(ValueError, match="decode_stack=on: the decode stack cannot run here .*" +
                       REFUSED[family]["decode_stack"]):
        Runner.from_folder(folders[family], "fp32", block_size=4, num_blocks=16,
                           fast_paths="attention=cpp,decode_stack=on")


@pytest.mark.parametrize("family", CASES)
def test_bf16_runner_tracks_fp32(folders, references, family):
    """bf16 logits within bf16's bound of transformers' fp32 ones, through the prompt and decode steps past both
    windows. No greedy check here: the soft-capped logits' top two lie closer than bf16 may move them (the greedy
    tokens are exact in fp32, above)."""
    runner = Runner.from_folder(folders[family], "bf16", block_size=BLOCK, num_blocks=32)
    assert runner.cache.k[0].dtype == torch.bfloat16
    alloc, seq = BlockAllocator(32), Seq("a", prompt(13, 4))
    runner.logits(StepInput([seq.chunk(6, alloc, BLOCK)]))
    for _ in range(8):        # the rest of the prompt, then decode steps on the reference's tokens
        logits, _ = runner.logits(StepInput([seq.chunk(len(seq.tokens) - seq.computed, alloc, BLOCK)]))
        with torch.no_grad():
            want = references[family](torch.tensor([seq.tokens])).logits[0, -1]
        assert_close(logits[0], want, dtype=torch.bfloat16, **TINY_SHAPE)
        seq.tokens.append(int(want.argmax()))


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


def test_the_screen_follows_the_final_soft_cap(folders, tmp_path):
    """The screen's refusal is the soft-capped logits, not the family: Gemma 2 without the cap keeps it, Gemma 3
    with one does not."""
    uncapped = _rewrite(folders["gemma2"], tmp_path / "uncapped", final_logit_softcapping=None)
    runner = Runner.from_folder(uncapped, "fp32", block_size=4, num_blocks=16, fast_paths="screen=on")
    assert runner.screen is not None and runner.plan.chosen("screen") == "on"
    capped = _rewrite(folders["gemma3_text"], tmp_path / "capped", final_logit_softcapping=3.0)
    runner = Runner.from_folder(capped, "fp32", block_size=4, num_blocks=16, fast_paths="screen=on")
    assert runner.screen is None and "gemma3_text soft-caps the logits" in runner.plan.get("screen").reason
