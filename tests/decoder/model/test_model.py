"""Our model code vs transformers on tiny random checkpoints; loading and refusals."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.model import ModelConfig, load_model
from services.decoder.model.rotary import Rotary, apply_rotary
from tests.decoder.model.checkpoints import CASES, TINY_SHAPE, build, load_reference
from tests.tolerance import assert_close

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build(root, name, seed=i) for i, name in enumerate(CASES)}


def causal_attention(layer, q, k, v, scale=None):
    """One sequence, no cache: q [N, H, D], k/v [N, KVH, D] -> [N, H, D]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def reference_attention(cfg):
    """causal_attention as cfg says, in plain torch: per layer its sliding window (a query at p sees keys
    p - w + 1 .. p) and the soft-cap of the scaled scores (cap * tanh(s / cap)), fp32."""
    def attend(layer, q, k, v, scale=None):
        n, h, d = q.shape
        g = h // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", q.float(), k.repeat_interleave(g, 1).float()) * (scale or d ** -0.5)
        if cfg.attn_softcap is not None:
            s = cfg.attn_softcap * torch.tanh(s / cfg.attn_softcap)
        pos = torch.arange(n)
        mask = pos[None, :] <= pos[:, None]
        window = cfg.layer_windows[layer] if cfg.layer_windows else None
        if window is not None:
            mask &= pos[None, :] > pos[:, None] - window
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(g, 1).float()).to(q.dtype)
    return attend


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(folders, name):
    ours, ref = load_model(folders[name], "fp32"), load_reference(folders[name])
    ids = torch.randint(0, ours.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = ref(ids).logits
        for b in range(2):
            hidden = ours(ours.embed(ids[b]), torch.arange(19), reference_attention(ours.config))
            assert_close(ours.logits(hidden), expected[b], **TINY_SHAPE, what=f"sequence {b}")
    assert expected.std() > 0.5, "logits too flat to be a meaningful comparison"


def test_config_fields(folders):
    cfg = ModelConfig.from_folder(folders["qwen3_odd3_gqa3_qknorm"])
    assert (cfg.family, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qk_norm) == ("qwen3", 3, 1, 32, True)
    assert cfg.eos_token_ids == (2, 3)          # generation_config.json wins over config.json
    assert cfg.max_position_embeddings == 256 and cfg.vocab_size == 160
    q2 = ModelConfig.from_folder(folders["qwen2_gqa2_odd_tied"])
    assert q2.qkv_bias and not q2.o_bias and q2.tie_word_embeddings


def test_tied_embeddings_share_storage(folders):
    model = load_model(folders["llama_gqa4_tied_sharded"], "fp32")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.is_meta for p in model.parameters())


def test_bf16_load_runs_close(folders):
    folder = folders["llama_mha_untied"]
    fp32, bf16 = load_model(folder, "fp32"), load_model(folder, "bf16")
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    ids = torch.arange(12) % 160
    with torch.no_grad():
        a = fp32.logits(fp32(fp32.embed(ids), torch.arange(12), causal_attention))
        b = bf16.logits(bf16(bf16.embed(ids), torch.arange(12), causal_attention))
    assert_close(b, a, dtype=torch.bfloat16, **TINY_SHAPE)


def _rewrite_config(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_legacy_rope_keys_and_refusals(folders, tmp_path):
    legacy = _rewrite_config(folders["llama_mha_untied"], tmp_path / "legacy", rope_parameters=None,
                             rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0})
    rope = load_model(legacy).config.rope       # transformers 4 spelling (tests/decoder/model/test_rope.py)
    assert (rope.kind, rope.factor, rope.theta) == ("linear", 2.0, 5000.0)
    # Sliding windows are served (tests/decoder/families/test_sliding_window.py); other layer types are not.
    sliding = _rewrite_config(folders["qwen2_gqa2_odd_tied"], tmp_path / "sw",
                              layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(Unsupported, match="layer_types"):
        load_model(sliding)
    gelu = _rewrite_config(folders["qwen2_gqa2_odd_tied"], tmp_path / "gelu", hidden_act="gelu")
    with pytest.raises(Unsupported, match="gelu"):
        load_model(gelu)


def test_broken_checkpoints_are_refused(folders, tmp_path):
    folder = _rewrite_config(folders["llama_mha_untied"], tmp_path / "wide", intermediate_size=128)
    with pytest.raises(InvalidArgument, match="shape"):
        load_model(folder)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(folders["llama_mha_untied"] / "config.json", empty / "config.json")
    with pytest.raises(InvalidArgument, match="safetensors"):
        load_model(empty)
    with pytest.raises(Unsupported, match="CPU"):
        load_model(folders["llama_mha_untied"], "fp16")


def test_mrope_with_equal_rows_is_plain_rope_exactly():
    plain, mrope = Rotary(32, 10000.0), Rotary(32, 10000.0, sections=(4, 6, 6))
    positions = torch.tensor([0, 1, 2, 7, 100, 4095])
    x = torch.randn(6, 3, 32)
    cp, sp = plain.cos_sin(positions, torch.float32)
    cm, sm = mrope.cos_sin(positions[None].expand(3, -1), torch.float32)
    assert torch.equal(cp, cm) and torch.equal(sp, sm)
    assert torch.equal(apply_rotary(x, cp, sp), apply_rotary(x, cm, sm))


def test_mrope_matches_transformers_qwen2_vl():
    from transformers import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb
    sections, theta = (2, 3, 3), 1e6
    cfg = Qwen2VLTextConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                            rope_parameters={"rope_type": "default", "rope_theta": theta,
                                             "mrope_section": list(sections)})
    positions = torch.tensor([[0, 1, 2, 2, 2, 2, 5, 6], [0, 1, 2, 2, 3, 3, 5, 6], [0, 1, 2, 3, 2, 3, 5, 6]])
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 1, 8, 16)
    ref_cos, ref_sin = Qwen2VLRotaryEmbedding(cfg)(q, positions[:, None, :])
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    cos, sin = Rotary(16, theta, sections).cos_sin(positions, torch.float32)
    # Elementwise: angle, cos/sin, then q * cos + rotate(q) * sin: a few roundings per element.
    assert_close(apply_rotary(q[0].transpose(0, 1), cos, sin), ref_q[0].transpose(0, 1), k=4)
    assert_close(apply_rotary(k[0].transpose(0, 1), cos, sin), ref_k[0].transpose(0, 1), k=4)


def test_mrope_sections_must_fill_head_dim():
    raw = {"model_type": "qwen2", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2, 2]}}
    with pytest.raises(InvalidArgument, match="mrope_section"):
        ModelConfig.from_dict(raw)
    raw["rope_parameters"]["mrope_section"] = [2, 3, 3]
    assert ModelConfig.from_dict(raw).mrope_sections == (2, 3, 3)
