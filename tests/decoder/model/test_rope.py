"""RoPE recipes (services/decoder/model/rope.py) vs transformers' own: frequencies, cos/sin, logits, refusals."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.model import ModelConfig, load_model
from services.decoder.model.rope import inverse_frequencies, parse
from services.decoder.model.rotary import Rotary
from tests.decoder.model.checkpoints import ROPE_CASES, TINY_SHAPE, build, load_reference
from tests.decoder.model.test_model import causal_attention
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics

_LONG = [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 30.0, 40.0, 55.0, 70.0, 80.0, 90.0, 95.0, 100.0]
# Recipes on a head_dim 32 config, with parameters the checkpoints do not use: each spelling transformers
# accepts, defaults left to it (yarn's betas, longrope's factor and attention factor) and given.
RECIPES = {
    "linear": {"rope_type": "linear", "factor": 3.5},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn_defaults": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    "yarn_full": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 128, "beta_fast": 16,
                  "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "attention_factor": 1.25},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0 + i / 20 for i in range(16)], "long_factor": _LONG},
    "longrope_factor": {"rope_type": "longrope", "original_max_position_embeddings": 64, "factor": 6.0,
                        "attention_factor": 1.1, "short_factor": [1.0] * 16, "long_factor": _LONG},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "llama3_wide_band": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 0.5, "high_freq_factor": 8.0,
                         "original_max_position_embeddings": 200},
}


def hf_config(params: dict, tmp_path, theta: float = 50000.0) -> LlamaConfig:
    """A Llama config with the recipe, as transformers reads it back from the config.json it writes."""
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_parameters={"rope_theta": theta, **params})
    cfg.save_pretrained(tmp_path)
    return LlamaConfig.from_pretrained(tmp_path)


def ours(tmp_path) -> ModelConfig:
    raw = json.loads((tmp_path / "config.json").read_text())
    return ModelConfig.from_dict({**raw, "vocab_size": 10, "intermediate_size": 8, "num_hidden_layers": 1})


@pytest.mark.parametrize("name", list(RECIPES))
def test_frequencies_equal_transformers_bit_for_bit(name, tmp_path):
    ref_cfg = hf_config(RECIPES[name], tmp_path)
    cfg = ours(tmp_path)
    kind = RECIPES[name]["rope_type"]
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS[kind](ref_cfg, torch.device("cpu"))
    inv, factor = inverse_frequencies(cfg.rope, cfg.head_dim)
    assert torch.equal(inv, ref_inv) and factor == ref_factor
    if kind in ("dynamic", "longrope"):       # the sequence-length-dependent sets, as transformers recomputes them
        for seq_len in (513, 700, 4096):
            arg = torch.tensor(seq_len) if kind == "dynamic" else seq_len
            ref_inv, _ = ROPE_INIT_FUNCTIONS[kind](ref_cfg, torch.device("cpu"), seq_len=arg)
            assert torch.equal(inverse_frequencies(cfg.rope, cfg.head_dim, seq_len=seq_len)[0], ref_inv)


def hf_cached_generation(ref: LlamaRotaryEmbedding, prompt: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [total, D] as transformers' cached generation forms them: the prompt in one forward, then one
    forward per new position (dynamic and longrope re-read the length each time)."""
    x = torch.zeros(1, 1, 4)
    calls = [torch.arange(prompt)] + [torch.tensor([p]) for p in range(prompt, total)]
    outs = [ref(x, ids[None]) for ids in calls]
    return torch.cat([c[0] for c, _ in outs]), torch.cat([s[0] for _, s in outs])


@pytest.mark.parametrize("name", list(RECIPES))
def test_cos_sin_equal_transformers_cached_generation(name, tmp_path):
    ref_cfg = hf_config(RECIPES[name], tmp_path)
    cfg = ours(tmp_path)
    # Past every switch position of these recipes (dynamic: 512, longrope: 64), from a prompt inside them.
    prompt, total = 40, 700
    ref_cos, ref_sin = hf_cached_generation(LlamaRotaryEmbedding(ref_cfg), prompt, total)
    rotary = Rotary(cfg.head_dim, cfg.rope)
    # In any order and any grouping: each token's tables depend on its position only.
    positions = torch.randperm(total, generator=torch.Generator().manual_seed(0))
    cos, sin = rotary.cos_sin(positions, torch.float32)
    half = cfg.head_dim // 2
    expected_sin = torch.cat((-ref_sin[:, :half], ref_sin[:, half:]), dim=-1)   # cos_sin's sign convention
    assert torch.equal(cos[:, 0], ref_cos[positions]) and torch.equal(sin[:, 0], expected_sin[positions])
    assert float(cos[positions == 0].max()) == pytest.approx(rotary.scale)    # the attention factor, on cos


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope")
    return {name: build(root, name, seed=60 + i) for i, name in enumerate(ROPE_CASES)}


@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_logits_match_transformers(folders, name):
    model, ref = load_model(folders[name], "fp32"), load_reference(folders[name])
    # One forward: dynamic and longrope stay below their switch position (16), as transformers' own
    # single forward would otherwise rotate every token by the whole length's frequencies.
    n = 16 if model.config.rope.switch_position else 40
    ids = torch.randint(4, 160, (n,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        got = model.logits(model(model.embed(ids), torch.arange(n), causal_attention))
    assert_close(got, expected, **TINY_SHAPE)
    assert expected.std() > 0.5


@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_bf16_follows_the_recipe(folders, name):
    """bf16 serving casts the recipe's fp32 tables (attention factor included) as transformers does."""
    model, ref = load_model(folders[name], "bf16"), load_reference(folders[name])
    ids = torch.randint(4, 160, (16,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        got = model.logits(model(model.embed(ids), torch.arange(16), causal_attention))
    assert_close(got, expected, dtype=torch.bfloat16, **TINY_SHAPE)


def test_qwen25_yarn_as_its_model_card_writes_it(folders, tmp_path):
    """Qwen2.5's long-context instructions add rope_scaling {"type": "yarn", ...} to config.json, next to a
    top-level rope_theta: transformers and the decoder read that spelling into the same model."""
    folder = shutil.copytree(folders["qwen25_yarn"], tmp_path / "legacy")
    raw = json.loads((folder / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw.update(rope_theta=params["rope_theta"], rope_scaling={
        "type": "yarn", "factor": params["factor"],
        "original_max_position_embeddings": params["original_max_position_embeddings"]})
    (folder / "config.json").write_text(json.dumps(raw))
    model, ref = load_model(folder, "fp32"), load_reference(folder)
    assert model.config.rope.kind == "yarn" and model.rotary.scale > 1.0
    ids = torch.randint(4, 160, (40,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        got = model.logits(model(model.embed(ids), torch.arange(40), causal_attention))
    assert_close(got, expected, **TINY_SHAPE)


def test_llama3_checkpoints_read_as_llama_3(folders):
    cfg = ModelConfig.from_folder(folders["llama32_llama3_rope_tied"])
    assert cfg.tie_word_embeddings and cfg.rope.kind == "llama3" and cfg.rope.factor == 32.0
    assert cfg.rope.original_max_position_embeddings == 128 and cfg.rope_theta == 500000.0
    assert cfg.rope.describe() == ("llama3 theta=500000 factor=32 original_max_position_embeddings=128 "
                                   "low_freq_factor=1 high_freq_factor=4")


def test_legacy_spellings_read_as_transformers_does():
    """Qwen2.5's YaRN as its model card writes it (rope_scaling with "type", rope_theta on top); Phi-3's
    original_max_position_embeddings on top, which wins over the recipe's own."""
    qwen = {"model_type": "qwen2", "max_position_embeddings": 32768, "rope_theta": 1000000.0,
            "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}
    rope, sections = parse(qwen)
    assert (rope.kind, rope.theta, rope.factor, rope.original_max_position_embeddings, sections) == \
        ("yarn", 1e6, 4.0, 32768, None)
    phi = {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
           "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}
    assert parse(phi)[0].original_max_position_embeddings == 4096
    assert parse({"max_position_embeddings": 999, "rope_parameters": {
        "rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4}})[0] \
        .original_max_position_embeddings == 999


@pytest.mark.parametrize("params, error, words", [
    ({"rope_type": "proportional", "rope_theta": 1e4}, Unsupported, "rope_parameters.rope_type 'proportional'"),
    ({"rope_type": "su", "rope_theta": 1e4}, Unsupported, "rope_parameters.rope_type 'su'"),
    ({"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}, Unsupported, "rope_parameters.factor"),
    ({"rope_type": "linear", "rope_theta": 1e4}, InvalidArgument, "lacks 'factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, InvalidArgument, "lacks 'high_freq_factor'"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "ramp": 1}, Unsupported,
     "rope_parameters.ramp"),
    ({"rope_type": "linear", "factor": "2"}, InvalidArgument, "rope_parameters.factor must be a number"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}, InvalidArgument,
     "short_factor has 3 values"),
    ({"rope_type": "yarn", "factor": 4.0, "mrope_section": [2, 3, 3]}, Unsupported, "with mrope_section"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, Unsupported, "partial_rotary_factor"),
])
def test_refusals_are_one_line_naming_the_key(params, error, words):
    raw = {"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 4, "rope_parameters": params}
    with pytest.raises(error) as info:
        ModelConfig.from_dict(raw)
    assert words in str(info.value) and "\n" not in str(info.value)
    if "rope_type" in params and params["rope_type"] in ("proportional", "su"):
        assert "supported: default, linear, dynamic, yarn, longrope, llama3" in str(info.value)
