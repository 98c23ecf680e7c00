"""Phi-3 and Phi-4-mini (model/phi3.py) vs transformers and peft through the runner and the engine.

Three checkpoints (tests/decoder/model/checkpoints.py): Phi-3 with whole-head rotary, Phi-4-mini's shape
(GQA, tied, partial_rotary_factor 0.75) and Phi-4-mini's longrope. Each runs with the fast paths pinned on
and pinned off: with whole-head rotary every path serves Phi-3 (the C++ decode stack included); with partial
rotary the decode stack is refused with the reason in the execution plan. A PEFT adapter on the fused
qkv_proj / gate_up_proj is split across our projections and must equal peft's own mixed batches.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.engine.step import SamplingParams, StepInput
from services.decoder.lora import adapter_request, load_peft
from services.decoder.model import ModelConfig, load_model
from services.decoder.model.config import FAMILIES
from services.decoder.model.families import MODELS
from services.decoder.model.phi3 import Phi3
from services.decoder.model.rotary import Rotary
from services.decoder.runner import Runner
from tests.decoder.families.engine_parity import check_chunks_preemption_and_n, check_prefix_hit, run_engine
from tests.decoder.families.test_granite_olmo2 import PLANS, prompt
from tests.decoder.lora.adapters import Spec, lora_engine, peft_mixed, register, write_adapter
from tests.decoder.model.checkpoints import TINY_SHAPE, build, greedy_reference, load_reference
from tests.decoder.model.test_model import causal_attention
from tests.decoder.model.test_quantization import dequantized_reference
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close, is_close

pytestmark = pytest.mark.numerics

BLOCK = 4
CASES = ["phi3_mha_untied", "phi4mini_gqa4_partial_tied", "phi3_longrope_partial"]
WHOLE = "phi3_mha_untied"                    # the one whose heads rotate whole: the decode stack serves it
PARTIAL_WHY = "phi3's partial rotary (partial_rotary_factor 0.75) rotates 12 of each head's 16 dims"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# The 23-token prompt plus its 12 tokens passes the longrope checkpoint's switch position (32).
PROMPTS = [[5, 9, 14, 3, 77, 21, 8], [40, 41], list(range(10, 33)), [7] * 13, [99, 3, 150, 12, 64]]


def pins(name: str, plan: str) -> str:
    """PLANS[plan], with the decode stack pinned on where it computes the checkpoint (whole-head rotary)."""
    return PLANS[plan] + (",decode_stack=on" if plan == "fast" and name == WHOLE else "")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3")
    return {name: build(root, name, seed=80 + i) for i, name in enumerate(CASES)}


@pytest.fixture(scope="module")
def references(folders):
    return {name: load_reference(folder) for name, folder in folders.items()}


def cached_greedy(ref, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own forward, one token per step over its KV cache, greedy. Phi3ForCausalLM.generate
    instead drops its cache when the sequence first passes original_max_position_embeddings and recomputes
    every token with longrope's long factors; the decoder keeps each token's rotation by its own position
    (model/rope.py), which is what this loop computes: each step's forward rotates its one token by the
    frequencies of its position."""
    from transformers import DynamicCache
    outs = []
    with torch.no_grad():
        for p in prompts:
            cache, ids, out = DynamicCache(config=ref.config), torch.tensor([p]), []
            for _ in range(max_new_tokens):
                out.append(int(ref(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].argmax()))
                ids = torch.tensor([[out[-1]]])
            outs.append(out)
    return outs


@pytest.fixture(scope="module")
def expected(folders, references):
    """Greedy tokens of transformers: its generate, or for longrope (whose generation here passes the
    switch) its cached forward step by step (cached_greedy says why)."""
    return {name: cached_greedy(references[name], PROMPTS, GREEDY.max_tokens) if "longrope" in name
            else greedy_reference(folder, PROMPTS, GREEDY.max_tokens) for name, folder in folders.items()}


def _rewrite(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_registry_and_config(folders):
    assert "phi3" in FAMILIES and MODELS["phi3"] is Phi3
    whole = ModelConfig.from_folder(folders[WHOLE])
    assert (whole.family, whole.num_kv_heads, whole.rope.partial_rotary_factor, whole.layer_windows) == \
        ("phi3", 4, 1.0, ())
    assert not (whole.qkv_bias or whole.o_bias or whole.mlp_bias or whole.tie_word_embeddings)
    mini = ModelConfig.from_folder(folders["phi4mini_gqa4_partial_tied"])
    assert (mini.num_heads, mini.num_kv_heads, mini.head_dim, mini.tie_word_embeddings) == (4, 1, 16, True)
    assert mini.rope.rotary_dim(mini.head_dim) == 12 and "partial_rotary_factor=0.75" in mini.rope.describe()
    long = ModelConfig.from_folder(folders["phi3_longrope_partial"])
    assert (long.rope.kind, long.rope.original_max_position_embeddings, long.rope.switch_position) == \
        ("longrope", 32, 32)
    assert isinstance(load_model(folders[WHOLE]), Phi3)


def test_loader_splits_the_fused_projections_by_rows(folders):
    folder = folders["phi4mini_gqa4_partial_tied"]
    stored = load_file(folder / "model.safetensors")
    model = load_model(folder)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features) == (64, 16, 16)
        assert torch.equal(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                           stored[f"model.layers.{i}.self_attn.qkv_proj.weight"])
        assert torch.equal(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                           stored[f"model.layers.{i}.mlp.gate_up_proj.weight"])


def test_refusals_are_one_line_naming_the_key(folders, tmp_path):
    src = folders[WHOLE]
    cases = [
        (dict(sliding_window=0), InvalidArgument, "sliding_window must be a positive integer"),
        (dict(partial_rotary_factor=0.7, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
         InvalidArgument, "leaves 11 rotary dims"),
        (dict(partial_rotary_factor=0.75, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
              model_type="llama"), Unsupported, "partial_rotary_factor 0.75 is not supported for model_type 'llama'"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}),
         InvalidArgument, "partial_rotary_factor must be a number in (0, 1]"),
    ]
    for i, (changes, error, words) in enumerate(cases):
        with pytest.raises(error) as info:
            load_model(_rewrite(src, tmp_path / str(i), **changes))
        assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
    # A window is recorded on every layer, as transformers applies it (runner/windows.py honours it); one wider
    # than the KV cache hides nothing, so the runner drops it (the decode stack still serves the model).
    wide = ModelConfig.from_folder(_rewrite(src, tmp_path / "wide", sliding_window=256))
    narrow = ModelConfig.from_folder(_rewrite(src, tmp_path / "narrow", sliding_window=100))
    assert (wide.layer_windows, narrow.layer_windows) == ((256, 256), (100, 100))
    # A fused tensor of the wrong height names itself and the rows it must hold.
    bad = shutil.copytree(src, tmp_path / "badqkv")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.self_attn.qkv_proj.weight"] = tensors["model.layers.1.self_attn.qkv_proj.weight"][:-1]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InvalidArgument, match=r"qkv_proj.weight' has shape \(191, 64\), expected \(192, 64\) "
                                              r"\(q_proj \| k_proj \| v_proj rows\)"):
        load_model(bad)


def test_longrope_without_original_length_reads_phi3s_default(folders, tmp_path):
    """Phi3Config fills original_max_position_embeddings with 4096 when config.json omits it; so do we."""
    from transformers import Phi3Config
    folder = _rewrite(folders["phi3_longrope_partial"], tmp_path / "noorig", original_max_position_embeddings=None,
                      max_position_embeddings=8192)
    raw = json.loads((folder / "config.json").read_text())
    raw["rope_parameters"].pop("original_max_position_embeddings")
    (folder / "config.json").write_text(json.dumps(raw))
    ref = Phi3Config.from_pretrained(folder)
    ours = ModelConfig.from_folder(folder)
    assert ours.rope.original_max_position_embeddings == ref.rope_parameters["original_max_position_embeddings"] \
        == 4096


@pytest.mark.parametrize("factor", [0.75, 0.5, 1.0])
def test_rotation_equals_transformers_bit_for_bit(factor):
    """apply_rotary over Rotary's tables (rotary_dim wide) is Phi-3's apply_rotary_pos_emb exactly: the first
    rotary_dim dims rotate in split-half pairs among themselves, the rest pass through untouched."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    from services.decoder.model.rope import RopeScaling
    from services.decoder.model.rotary import apply_rotary
    cfg = Phi3Config(hidden_size=256, num_attention_heads=8, partial_rotary_factor=factor,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor})
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 8, 40, 32, generator=g), torch.randn(1, 2, 40, 32, generator=g)
    positions = torch.arange(40) * 37
    cos, sin = Phi3RotaryEmbedding(cfg)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    rotary = Rotary(32, RopeScaling(partial_rotary_factor=factor))
    ours_cos, ours_sin = rotary.cos_sin(positions, torch.float32)
    assert ours_cos.shape == (40, 1, int(32 * factor))
    for x, want in ((q, want_q), (k, want_k)):
        got = apply_rotary(x[0].transpose(0, 1), ours_cos, ours_sin)          # [N, H, D]
        assert torch.equal(got, want[0].transpose(0, 1))


def test_partial_rotary_and_longrope_factors_matter(folders):
    """Rotating whole heads, or longrope's factors left out, changes the logits beyond rounding: the parity
    tests below would see either."""
    ids = torch.randint(4, 160, (19,), generator=torch.Generator().manual_seed(2))

    def logits(model):
        with torch.no_grad():
            return model.logits(model(model.embed(ids), torch.arange(19), causal_attention))

    for name in ("phi4mini_gqa4_partial_tied", "phi3_longrope_partial"):
        model = load_model(folders[name])
        base = logits(model)
        whole = dataclasses.replace(model.config.rope, partial_rotary_factor=1.0,
                                    short_factor=(1.0,) * 8, long_factor=(1.0,) * 8)
        model.rotary = Rotary(model.config.head_dim, whole)
        assert not is_close(logits(model), base, **TINY_SHAPE), name
    model = load_model(folders["phi3_longrope_partial"])
    base = logits(model)
    model.rotary = Rotary(16, dataclasses.replace(model.config.rope, kind="default"))
    assert not is_close(logits(model), base, **TINY_SHAPE)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", CASES)
def test_chunked_prefill_then_decode_matches_transformers(folders, references, name, plan):
    runner = Runner.from_folder(folders[name], "fp32", block_size=BLOCK, num_blocks=64, fast_paths=pins(name, plan))
    if name != WHOLE and plan != "reference":
        choice = runner.plan.get("decode_stack")
        assert choice.chosen == "off" and PARTIAL_WHY in choice.reason, choice
        assert runner.fused_decode is None
    if name == WHOLE and plan == "fast":
        assert runner.fused_decode is not None and runner.plan.chosen("decode_stack").startswith("on")
    ref = references[name]
    alloc, seq = BlockAllocator(64), Seq("a", prompt(23, 1))
    for size in (5, 1, 9, 8):                  # uneven, and one 1-token chunk mid-prompt
        out = runner.execute(StepInput([seq.chunk(size, alloc, BLOCK)]))
        assert out.sampled == {} or seq.computed == 23
    produced = [out.sampled["a"].token_id]
    seq.tokens.append(produced[-1])
    for _ in range(7):                         # to position 30: inside longrope's short factors
        logits, _ = runner.logits(StepInput([seq.chunk(1, alloc, BLOCK)]))
        with torch.no_grad():
            want = ref(torch.tensor([seq.tokens])).logits[0, -1]
        assert_close(logits[0], want, **TINY_SHAPE)
        produced.append(int(logits[0].argmax()))
        seq.tokens.append(produced[-1])
    with torch.no_grad():
        expected = ref.generate(torch.tensor([seq.tokens[:23]]), do_sample=False, max_new_tokens=8,
                                pad_token_id=0)[0, 23:].tolist()
    assert produced == expected


def test_decode_stack_pinned_on_is_refused_for_partial_rotary(folders):
    why = re.escape(PARTIAL_WHY)
    with pytest.raises(ValueError, match="decode_stack=on: the decode stack cannot run here .*" + why):
        Runner.from_folder(folders["phi4mini_gqa4_partial_tied"], "fp32", block_size=BLOCK, num_blocks=16,
                           fast_paths="attention=cpp,decode_stack=on")


def run_stacked(folder, fast_paths: str, **kw):
    """engine_parity.run_engine, counting the C++ decode stack's calls -> (ids, stats, calls)."""
    stacked = []

    def count(runner):
        if runner.fused_decode is not None:
            run = runner.fused_decode._run
            runner.fused_decode._run = lambda *a: stacked.append(1) or run(*a)
    got, stats = run_engine(folder, PROMPTS, GREEDY, fast_paths=fast_paths, on_runner=count, **kw)
    return got, stats, len(stacked)


@pytest.mark.parametrize("name", CASES)
def test_engine_equals_transformers_through_chunks_preemption_and_n(folders, expected, name):
    folder, want = folders[name], expected[name]
    # Small chunks of staggered arrivals (chunked prefill), with the fast paths pinned on and off.
    for plan in ("fast", "reference"):
        got, _, stacked = run_stacked(folder, pins(name, plan), budget=5, stagger=3)
        assert [g[0] for g in got] == want, plan
        assert (stacked > 0) == (plan == "fast" and name == WHOLE)
    # A KV pool small enough to preempt, and n = 2 greedy choices sharing the prompt's blocks.
    check_chunks_preemption_and_n(folder, PROMPTS, GREEDY, want, ())


@pytest.mark.parametrize("name", CASES)
def test_prefix_hit_same_output_and_cached_tokens(folders, expected, name):
    check_prefix_hit(folders[name], PROMPTS[2], GREEDY, expected[name][2])


@pytest.mark.parametrize("name", CASES)
def test_bf16_and_int8_runners(folders, references, name):
    bf16 = Runner.from_folder(folders[name], "bf16", block_size=BLOCK, num_blocks=32)
    int8 = Runner.from_folder(folders[name], "fp32", block_size=BLOCK, num_blocks=32, quantization="int8")
    dequantized = dequantized_reference(folders[name])
    tokens = prompt(13, 4)
    for runner, ref, dtype in ((bf16, references[name], torch.bfloat16), (int8, dequantized, torch.int8)):
        alloc, seq = BlockAllocator(32), Seq("a", list(tokens))
        runner.logits(StepInput([seq.chunk(6, alloc, BLOCK)]))
        logits, _ = runner.logits(StepInput([seq.chunk(7, alloc, BLOCK)]))
        with torch.no_grad():
            want = ref(torch.tensor([seq.tokens])).logits[0, -1]
        assert_close(logits[0], want, dtype=dtype, **TINY_SHAPE)


# Adapters on the checkpoint's own (fused) names, of different ranks, alphas and target sets.
PHI3_SPECS = (
    Spec("alpha", 4, 8.0, ("qkv_proj",), 1),
    Spec("beta", 8, 4.0, ("qkv_proj", "o_proj"), 2),
    Spec("gamma", 2, 2.0, ("gate_up_proj", "down_proj", "o_proj"), 3),
)
LORA_CASES = ["phi4mini_gqa4_partial_tied", WHOLE]
WORKLOAD = [(0, "alpha"), (1, None), (2, "beta"), (0, "gamma"), (3, "alpha"), (2, None), (1, "beta"),
            (3, "gamma"), (0, None), (2, "alpha")]


@pytest.fixture(scope="module", params=LORA_CASES)
def lora_setup(request, folders, tmp_path_factory):
    base = folders[request.param]
    root = tmp_path_factory.mktemp("phi3lora")
    adapters = {s.name: write_adapter(base, root, s) for s in PHI3_SPECS}
    return base, adapters, peft_mixed(base, adapters)


def test_fused_adapter_splits_lora_b_rows_and_shares_lora_a(lora_setup):
    base, adapters, _ = lora_setup
    core, registry = lora_engine(base)
    bank = registry.bank
    weights = load_peft(adapters["beta"], layers=bank.shapes, max_rank=8, dtype=torch.float32, fused=bank.fused)
    stored = load_file(adapters["beta"] / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.qkv_proj.lora_{}.weight"
    parts = [weights.modules[f"model.layers.1.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")]
    assert all(torch.equal(a, stored[key.format("A")]) for a, _ in parts)
    assert torch.equal(torch.cat([b for _, b in parts]), stored[key.format("B")] * (4.0 / 8))
    assert weights.targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    # Without the family's fused names the adapter names modules this model does not have.
    with pytest.raises(Unsupported, match="target 'qkv_proj' is not supported"):
        load_peft(adapters["beta"], layers=bank.shapes, max_rank=8, dtype=torch.float32)
    # A bank that wraps only some of a fused projection's parts cannot take an adapter on it.
    _, partial = lora_engine(base, targets=("q_proj", "v_proj", "o_proj"))
    with pytest.raises(InvalidArgument, match="target 'qkv_proj' is not enabled on this server"):
        load_peft(adapters["beta"], layers=partial.bank.shapes, max_rank=8, dtype=torch.float32,
                  fused=partial.bank.fused)


@pytest.mark.parametrize("path", ["dense", "segments", "pool"])
def test_mixed_batch_logits_match_peft(lora_setup, path):
    """The bank's two CPU forms and the CPU adapter pool, over Phi-3's fused checkpoint projections."""
    base, adapters, peft = lora_setup
    core, registry = lora_engine(base, pool_bytes=2**24 if path == "pool" else None)
    seen = []
    if path != "pool":
        registry.bank.dense_max_work = 10**9 if path == "dense" else 0
        real_activate = registry.bank.activate

        @contextmanager
        def spy(spans, num_rows):
            with real_activate(spans, num_rows) as meta:
                seen.append(registry.bank.step.dense_mask is not None)
                yield meta
        registry.bank.activate = spy
    for name, folder in adapters.items():
        register(registry, name, folder)
    rows = ["alpha", "__base__", "beta", "gamma", "alpha", "__base__"]
    prompts = torch.randint(4, 150, (len(rows), 9), generator=torch.Generator().manual_seed(7))
    alloc = BlockAllocator(128)
    seqs = [Seq(str(i), prompts[i].tolist(), lora_slot=None if n == "__base__" else registry.status(n).slot)
            for i, n in enumerate(rows)]
    got, _ = core.runner.logits(StepInput([s.chunk(9, alloc, 4) for s in seqs]))
    with torch.no_grad():
        want = peft(input_ids=prompts, adapter_names=rows).logits[:, -1].float()
        base_only = peft(input_ids=prompts, adapter_names=["__base__"] * len(rows)).logits[:, -1].float()
    assert_close(got, want, **TINY_SHAPE)
    assert seen == ([] if path == "pool" else [path == "dense"])
    for i, n in enumerate(rows):
        if n == "__base__":
            assert torch.equal(want[i], base_only[i])
        else:
            assert not is_close(want[i], base_only[i], **TINY_SHAPE), n


def test_engine_greedy_equals_peft_generate(lora_setup):
    base, adapters, peft = lora_setup
    expected = []
    for p, a in WORKLOAD:
        ids = torch.tensor([PROMPTS[p]])
        with torch.no_grad():
            out = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                do_sample=False, eos_token_id=None, pad_token_id=0, adapter_names=[a or "__base__"])
        expected.append(out[0, ids.shape[1]:].tolist())
    core, registry = lora_engine(base, budget=5)
    digests = {n: register(registry, n, f).digest for n, f in adapters.items()}
    sampling = dataclasses.replace(GREEDY, max_tokens=8)
    got = {str(i): [] for i in range(len(WORKLOAD))}
    pending, steps = list(enumerate(WORKLOAD)), 0
    while pending or core.has_unfinished():
        if pending and steps % 2 == 0:
            i, (p, a) = pending.pop(0)
            adapter, keys = adapter_request(a, digests[a]) if a else (None, ())
            core.add_request(str(i), PROMPTS[p], sampling, extra_keys=keys, adapter=adapter)
        for out in core.step():
            got[out.request_id].extend(out.new_token_ids)
        steps += 1
        assert steps < 3000
    assert [got[str(i)] for i in range(len(WORKLOAD))] == expected
    assert expected[0] != expected[8] and expected[5] != expected[9]     # the adapters change greedy tokens
    core.check_idle()
    assert registry.total_refs == 0
