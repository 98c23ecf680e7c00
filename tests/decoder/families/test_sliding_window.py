"""Sliding-window attention and the attention soft-cap (runner/windows.py) vs plain torch and transformers.

Mistral (every layer slides) and Qwen2 with use_sliding_window (layers from max_window_layers slide) run
through the runner and the engine with the fast paths pinned on and off; the attention paths (prefill SDPA,
the torch decode, the C++ operator) are checked against masks and tanh written out; and a Mistral whose
every layer slides returns the blocks that left its window to the pool while it generates.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.engine.config import EngineConfig, SpeculativeConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.kv_cache_manager import FREED, cdiv
from services.decoder.engine.step import SamplingParams, StepInput
from services.decoder.kernels import paged_attention_cpu
from services.decoder.model import ModelConfig
from services.decoder.model.decoder import CausalLM
from services.decoder.model.families import MODELS
from services.decoder.runner import Runner
from services.decoder.runner.attention import CPP, TORCH, AttentionPlan, PagedAttention, Workspace
from services.decoder.runner.kv_cache import KVCache
from services.decoder.runner.windows import Windows, binding
from tests.decoder.drive import drive, token_ids
from tests.decoder.model.checkpoints import TINY_SHAPE, build, greedy_reference, load_reference
from tests.decoder.model.test_quantization import dequantized_reference
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close, is_close

pytestmark = pytest.mark.numerics

BLOCK = 4
CASES = {"mistral": "mistral_gqa2_window8", "qwen2": "qwen2_sliding_layers"}
WINDOWS = {"mistral": (8, 8), "qwen2": (None, 6)}
PLANS = {
    "fast": "gemv=on,glue=cpp,attention=cpp,screen=on,grammar_mask=xgrammar",
    "reference": "linear=plain,gemv=off,glue=torch,attention=torch,decode_stack=off,screen=off,"
                 "grammar_mask=unpacked,huge_pages=off",
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 77, 21, 8], list(range(10, 33)), [7] * 13, [99, 3, 150, 12, 64, 8, 8, 30, 31, 90, 2, 4]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sliding")
    return {family: build(root, name, seed=80 + i) for i, (family, name) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def expected(folders):
    return {family: greedy_reference(folder, PROMPTS, GREEDY.max_tokens) for family, folder in folders.items()}


def _rewrite(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


# -- config ---------------------------------------------------------------------------------------------

BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2)


def windows(**raw) -> tuple[int | None, ...]:
    return ModelConfig.from_dict({**BASE, **raw}).layer_windows


def test_config_reads_windows_as_transformers_does(folders):
    assert windows(model_type="mistral", sliding_window=4096) == (4096,) * 4
    assert windows(model_type="mistral", sliding_window=None) == ()
    # Mistral's class ignores layer_types (transformers warns and slides every layer).
    assert windows(model_type="mistral", sliding_window=8, layer_types=["full_attention"] * 4) == (8,) * 4
    # Qwen2/3: only with use_sliding_window; layers from max_window_layers slide, unless layer_types says.
    assert windows(model_type="qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=2) == \
        (None, None, 6, 6)
    assert windows(model_type="qwen2", use_sliding_window=False, sliding_window=6, max_window_layers=2) == ()
    assert windows(model_type="qwen3", use_sliding_window=True, sliding_window=5,
                   layer_types=["sliding_attention", "full_attention"] * 2) == (5, None, 5, None)
    assert ModelConfig.from_folder(folders["mistral"]).layer_windows == WINDOWS["mistral"]
    assert ModelConfig.from_folder(folders["qwen2"]).layer_windows == WINDOWS["qwen2"]
    assert MODELS["mistral"] is CausalLM


def test_what_is_not_implemented_is_refused_in_one_line():
    with pytest.raises(Unsupported, match="layer_types sliding_attention is not supported for llama"):
        windows(model_type="llama", sliding_window=4, layer_types=["sliding_attention"] * 4)
    with pytest.raises(Unsupported, match=r"layer_types \['chunked_attention'\] are not supported"):
        windows(model_type="qwen2", layer_types=["chunked_attention"] * 4)
    with pytest.raises(InvalidArgument, match="sliding_window must be a positive integer"):
        windows(model_type="mistral", sliding_window=0)
    with pytest.raises(InvalidArgument, match="sliding_window must be a positive integer"):
        windows(model_type="qwen3", sliding_window=None, layer_types=["sliding_attention"] * 4)
    with pytest.raises(InvalidArgument, match="one type per layer"):
        windows(model_type="qwen3", layer_types=["full_attention"])


def test_a_window_wider_than_the_cache_hides_nothing(folders, tmp_path):
    """min(p + 1, w) keys must all sit in held blocks, so w > the cache's slots never binds: dropped."""
    assert binding((8, None), 16) == (8, None) and binding((16, 16), 16) == (16, 16)
    assert binding((17, 17), 16) == () and binding((None, 40, 6), 16) == (None, None, 6)
    wide = _rewrite(folders["mistral"], tmp_path / "wide", sliding_window=300)
    runner = Runner.from_folder(wide, "fp32", block_size=BLOCK, num_blocks=64, fast_paths="attention=cpp")
    assert runner.windows.layers == () and runner.attention_reach is None
    assert "sliding-window" not in runner.plan.get("decode_stack").reason


@pytest.mark.parametrize("family", CASES)
def test_transformers_reference_applies_the_window(folders, tmp_path, family):
    """The parity below means something: transformers' own logits change when the window is dropped."""
    full = _rewrite(folders[family], tmp_path / "full", sliding_window=None, use_sliding_window=False,
                    **({"layer_types": ["full_attention"] * 2} if family == "qwen2" else {}))
    ids = torch.randint(4, 160, (1, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        windowed, plain = load_reference(folders[family])(ids).logits[0], load_reference(full)(ids).logits[0]
    first_slid = min(w for w in WINDOWS[family] if w is not None)
    assert_close(windowed[:first_slid], plain[:first_slid], **TINY_SHAPE)   # nothing has left the window yet
    assert not is_close(windowed[first_slid:], plain[first_slid:], **TINY_SHAPE)


# -- attention against masks and tanh written out ---------------------------------------------------------

def plain_attention(q, k, v, window, softcap, scale):
    """One sequence's queries at positions len(k) - len(q) .. len(k) - 1 over all its keys: [L, H, D]."""
    n, length, g = k.shape[0], q.shape[0], q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.float(), k.repeat_interleave(g, 1).float()) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    qp, kp = torch.arange(n - length, n)[:, None], torch.arange(n)[None, :]
    mask = (kp <= qp) & ((kp > qp - window) if window is not None else True)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~mask, float("-inf")), -1),
                        v.repeat_interleave(g, 1).float())


@pytest.mark.parametrize("backend", [CPP, TORCH])
@pytest.mark.parametrize("layers, softcap", [((None, 5), None), ((5, 11), None), ((None, 7), 1.5), ((9, 9), 2.0)],
                         ids=["mixed", "all-sliding", "mixed-softcap", "sliding-softcap"])
def test_paged_attention_honours_windows_and_softcap(backend, layers, softcap):
    """Every kind of span (a first chunk, long and short chunks after a context, decode rows) on each layer's
    window; where every layer slides, the table entries before the first read key are FREED (never read)."""
    torch.manual_seed(0)
    h, kvh, d, bs, nblocks = 4, 2, 16, BLOCK, 64
    win = Windows(layers, softcap)
    cache = KVCache(2, nblocks, bs, kvh, d, torch.float32, huge_pages=False)
    # (tokens already cached, new tokens): a 30-token first chunk, chunks after 9 / 20 keys, decode rows.
    shapes = [(0, 30), (20, 24), (9, 5), (3, 1), (37, 1), (12, 1)]
    free, spans, seqs = list(range(nblocks)), [], []
    for start, length in shapes:
        table = [free.pop() for _ in range(cdiv(start + length, bs))]
        spans.append((start, length, table))
        ks, vs = torch.randn(start + length, kvh, d), torch.randn(start + length, kvh, d)
        seqs.append((ks, vs, torch.randn(length, h, d) * 3))
        for layer in range(2):       # the context's K/V already in the cache
            for p in range(start):
                cache.k[layer][table[p // bs], p % bs], cache.v[layer][table[p // bs], p % bs] = ks[p], vs[p]
    if win.reach is not None:        # blocks wholly before the first key any layer reads: freed by the engine
        spans = [(s, n, [FREED if (j + 1) * bs <= win.first_key(s) else b for j, b in enumerate(t)])
                 for s, n, t in spans]
    plan = AttentionPlan.build(spans, bs, torch.device("cpu"), backend, win)
    if backend == CPP:                # the first chunk and the 5-token one run as the operator's rows
        assert plan.decode_rows is not None and len(plan.prefills) == 1
    else:
        assert len(plan.prefills) == 3 and plan.decode
    q = torch.cat([s[2] for s in seqs])
    k = torch.cat([s[0][start:] for s, (start, _) in zip(seqs, shapes, strict=True)])
    v = torch.cat([s[1][start:] for s, (start, _) in zip(seqs, shapes, strict=True)])
    attend = PagedAttention(cache, plan, Workspace())
    for layer, window in enumerate(layers):
        out = attend(layer, q, k, v)
        row = 0
        for (ks, vs, qs), (_, length) in zip(seqs, shapes, strict=True):
            want = plain_attention(qs, ks, vs, window, softcap, 1 / math.sqrt(d))
            assert_close(out[row:row + length], want, k=d, what=f"layer {layer} rows {row}..")
            row += length


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operator_first_keys_and_softcap_match_its_reference(dtype):
    torch.manual_seed(1)
    h, kvh, d, bs, nblocks = 8, 2, 64, 16, 40
    kc, vc = torch.randn(nblocks, bs, kvh, d).to(dtype), torch.randn(nblocks, bs, kvh, d).to(dtype)
    lens = torch.tensor([1, 17, 200, 300, 64], dtype=torch.int32)           # 300: a row cut into stretches
    firsts = torch.tensor([0, 16, 150, 7, 63], dtype=torch.int32)
    tables = torch.stack([torch.randperm(nblocks)[:20] for _ in lens]).to(torch.int32)
    tables[2, :150 // bs] = FREED                                            # never read: before the first key
    q = (torch.randn(len(lens), h, d) * 4).to(dtype)
    for softcap in (None, 3.0):
        got = paged_attention_cpu.paged_decode(q, kc, vc, tables, lens, first_keys=firsts, softcap=softcap)
        tables_ref = tables.clamp(min=0)
        want = paged_attention_cpu.paged_decode_ref(q, kc, vc, tables_ref, lens, first_keys=firsts, softcap=softcap)
        assert_close(got, want, dtype=dtype, k=300, what=f"softcap {softcap}")
        whole = paged_attention_cpu.paged_decode_ref(q, kc, vc, tables_ref, lens, softcap=softcap)
        assert not is_close(want[2:4], whole[2:4], dtype=dtype, k=300)       # the first keys matter
    plain = paged_attention_cpu.paged_decode_ref(q, kc, vc, tables.clamp(min=0), lens, first_keys=firsts)
    assert not is_close(got, plain, dtype=dtype, k=300)                      # and so does the soft-cap
    with pytest.raises(RuntimeError, match="first_keys"):
        paged_attention_cpu.paged_decode(q, kc, vc, tables, lens, first_keys=lens)


# -- the runner and the engine against transformers ------------------------------------------------------

@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("family", CASES)
def test_chunked_prefill_then_decode_matches_transformers(folders, family, plan):
    runner = Runner.from_folder(folders[family], "fp32", block_size=BLOCK, num_blocks=64, fast_paths=PLANS[plan])
    assert runner.fused_decode is None
    if plan == "fast":
        choice = runner.plan.get("decode_stack")
        assert choice.chosen == "off" and "sliding-window" in choice.reason, choice
        assert runner.attention_backend == CPP
    ref = load_reference(folders[family])
    alloc, seq = BlockAllocator(64), Seq("a", list(PROMPTS[1]))
    for size in (5, 1, 9, 8):                  # uneven, one 1-token chunk mid-prompt, chunks past the window
        out = runner.execute(StepInput([seq.chunk(size, alloc, BLOCK)]))
    produced = [out.sampled["a"].token_id]
    seq.tokens.append(produced[-1])
    for _ in range(9):
        logits, _ = runner.logits(StepInput([seq.chunk(1, alloc, BLOCK)]))
        with torch.no_grad():
            want = ref(torch.tensor([seq.tokens])).logits[0, -1]
        assert_close(logits[0], want, **TINY_SHAPE)
        produced.append(int(logits[0].argmax()))
        seq.tokens.append(produced[-1])
    with torch.no_grad():
        expected = ref.generate(torch.tensor([PROMPTS[1]]), do_sample=False, max_new_tokens=10,
                                pad_token_id=0)[0, len(PROMPTS[1]):].tolist()
    assert produced == expected


@pytest.mark.parametrize("family", CASES)
def test_bf16_and_int8_runners_track_their_references(folders, family):
    """Past the window: a 13-token context, then decode rows that read it back through the window."""
    for dtype, quantization in (("bf16", "none"), ("fp32", "int8")):
        runner = Runner.from_folder(folders[family], dtype, block_size=BLOCK, num_blocks=32,
                                    quantization=quantization)
        ref = dequantized_reference(folders[family]) if quantization == "int8" else load_reference(folders[family])
        alloc, seq = BlockAllocator(32), Seq("a", list(PROMPTS[2]))
        runner.logits(StepInput([seq.chunk(6, alloc, BLOCK)]))
        for _ in range(4):
            logits, _ = runner.logits(StepInput([seq.chunk(len(seq.tokens) - seq.computed, alloc, BLOCK)]))
            with torch.no_grad():
                want = ref(torch.tensor([seq.tokens])).logits[0, -1]
            torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.int8
            assert_close(logits[0], want, dtype=torch_dtype, **TINY_SHAPE)
            seq.tokens.append(int(want.argmax()))


def test_decode_stack_pinned_on_is_refused_with_the_reason(folders):
    with pytest.raises(ValueError, match="decode_stack=on: the decode stack cannot run here .*sliding-window"):
        Runner.from_folder(folders["mistral"], "fp32", block_size=BLOCK, num_blocks=16,
                           fast_paths="attention=cpp,decode_stack=on")


def run_engine(folder, *, num_blocks=256, budget=512, stagger=1, prefix_caching=True, fast_paths="screen=on",
               prompts=PROMPTS, sampling=GREEDY):
    runner = Runner.from_folder(folder, "fp32", BLOCK, num_blocks, fast_paths=fast_paths)
    core = EngineCore(runner, EngineConfig(block_size=BLOCK, num_blocks=num_blocks, max_num_batched_tokens=budget,
                                           max_num_seqs=8, max_model_len=128, enable_prefix_caching=prefix_caching))
    return token_ids(drive(core, prompts, sampling, stagger=stagger), len(prompts)), core


@pytest.mark.parametrize("family", CASES)
def test_engine_equals_transformers_through_chunks_prefix_hits_and_preemption(folders, expected, family):
    folder, want = folders[family], expected[family]
    for pins in PLANS.values():                # small chunks of staggered arrivals
        got, core = run_engine(folder, budget=5, stagger=3, fast_paths=pins)
        assert got == want, pins
    assert core.config.attention_reach == (8 if family == "mistral" else None)
    # The same prompts again after them: each is a prefix hit on blocks the first run computed.
    got, core = run_engine(folder, prompts=PROMPTS + PROMPTS, stagger=0, budget=16)
    assert got == want + want and core.stats().prefix_hits > 0
    # A KV pool small enough to preempt (Mistral's freed blocks make it smaller: the longest request's 9).
    small = dict(num_blocks=9, budget=8, stagger=0) if family == "mistral" else dict(num_blocks=12, budget=16)
    got, core = run_engine(folder, prefix_caching=False, **small)
    assert core.stats().num_preemptions > 0 and got == want
    # n = 2 greedy choices share the prompt's blocks (Mistral's freed ones too); each equals the one answer.
    runner = Runner.from_folder(folder, "fp32", BLOCK, 256, fast_paths="screen=on")
    core = EngineCore(runner, EngineConfig(block_size=BLOCK, num_blocks=256, max_num_seqs=8, max_model_len=128))
    tokens = drive(core, PROMPTS, dataclasses.replace(GREEDY, n=2))
    assert [[[t.token_id for t in tokens[(i, c)]] for c in range(2)] for i in range(len(PROMPTS))] == \
        [[w, w] for w in want]


def test_speculative_drafts_through_the_window_equal_transformers(folders, expected):
    """n-gram drafts verified across the window's edge; rejected drafts' blocks trimmed, passed ones freed."""
    runner = Runner.from_folder(folders["mistral"], "fp32", BLOCK, 64, fast_paths="screen=on")
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1,
                             disable_by_batch_size=8)
    core = EngineCore(runner, EngineConfig(block_size=BLOCK, num_blocks=64, max_model_len=128, speculative=spec))
    got = token_ids(drive(core, PROMPTS, GREEDY, stagger=0), len(PROMPTS))
    assert got == expected["mistral"] and core.stats().num_verifications > 0


# -- freed blocks ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def window16(folders, tmp_path_factory):
    return _rewrite(folders["mistral"], tmp_path_factory.mktemp("w16") / "mistral_window16", sliding_window=16)


@pytest.mark.parametrize("pins", list(PLANS))
def test_a_long_generation_holds_only_its_window(window16, pins):
    """Window 16, blocks of 4: after each step the request holds the blocks of keys p - 15 .. p - 1 plus its
    next position's (at most cdiv(16, 4) + 1), freed ones are FREED in its table, and the tokens still equal
    transformers'; a second request then hits the first one's freed, cached blocks."""
    prompt = PROMPTS[1] + PROMPTS[3]                                       # 35 tokens
    sampling = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    want = greedy_reference(window16, [prompt], sampling.max_tokens)[0]
    runner = Runner.from_folder(window16, "fp32", BLOCK, 64, fast_paths=PLANS[pins])
    core = EngineCore(runner, EngineConfig(block_size=BLOCK, num_blocks=64, max_num_batched_tokens=8,
                                           max_model_len=128))
    assert core.config.attention_reach == 16
    limit = cdiv(16, BLOCK) + 1
    for rid in ("a", "b"):
        core.add_request(rid, prompt, sampling)
        tokens, held, cached = [], [], 0
        while core.has_unfinished():
            for out in core.step():
                tokens.extend(out.new_token_ids)
                cached = out.num_cached_tokens
            req = core.scheduler.requests.get(rid)
            if req is not None:
                live = [b for b in req.block_ids if b != FREED]
                assert req.block_ids[:len(req.block_ids) - len(live)] == [FREED] * (len(req.block_ids) - len(live))
                held.append(len(live))
        assert tokens == want, rid
        assert max(held) <= limit and held[-1] <= limit, held
        core.check_idle()
    assert cached > 0                                                      # "b" hit "a"'s blocks


def test_abort_mid_generation_returns_every_block(window16):
    runner = Runner.from_folder(window16, "fp32", BLOCK, 32, fast_paths=PLANS["reference"])
    core = EngineCore(runner, EngineConfig(block_size=BLOCK, num_blocks=32, max_num_batched_tokens=16,
                                           max_model_len=128))
    core.add_request("a", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    core.add_request("b", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(20):
        core.step()
    assert FREED in core.scheduler.requests["a"].block_ids
    core.abort("a")
    core.abort("b")
    core.step()
    assert not core.has_unfinished()
    core.check_idle()


# -- the served model: blocks over gRPC while it streams, and idle after finish and cancel ---------------

@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory):
    """The decoder gRPC server on a tiny Mistral (window 8) with SmolLM2's tokenizer: (stub, folder)."""
    import grpc

    from services.common.pb import decoder_pb2_grpc
    from services.decoder.server.config import DecoderConfig, DecoderServerConfig
    from services.decoder.server.service import start
    from tests.decoder.server.conftest import write_tiny_chat_llama
    from tests.loops import LoopThread
    folder = write_tiny_chat_llama(tmp_path_factory.mktemp("served") / "tiny-mistral", seed=5)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8)
    (folder / "config.json").write_text(json.dumps(raw))
    loop = LoopThread()
    cfg = DecoderConfig(model=str(folder), num_blocks=64, block_size=BLOCK, max_num_batched_tokens=32,
                        fast_paths="screen=on")
    server, servicer = loop.run(start(DecoderServerConfig(host="127.0.0.1", port=0), cfg))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield decoder_pb2_grpc.DecoderServiceStub(channel), folder
    loop.run(server.stop(0))
    assert servicer.close()    # the engine, then the grammar compiler's threads
    loop.close()


def test_served_generation_holds_its_window_and_ends_idle(mistral_server):
    from services.common.pb import decoder_pb2 as D
    from tests.decoder.idle import stats, wait_idle
    stub, folder = mistral_server
    prompt = list(range(300, 340))
    req = D.GenerateRequest(token_ids=D.TokenIds(ids=prompt),
                            sampling=D.SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    ids, used = [], []
    for m in stub.Generate(req):
        ids.extend(m.token_ids)
        if 10 <= len(ids) < 60:
            s = stats(stub)
            used.append(s.total_blocks - s.free_blocks)
    # Window 8 over blocks of 4: 3 blocks of keys and the next position's, against 25 without freeing.
    assert used and max(used) <= cdiv(8, BLOCK) + 2, used
    assert ids == greedy_reference(folder, [prompt], 60)[0]
    wait_idle(stub)
    call = stub.Generate(D.GenerateRequest(token_ids=D.TokenIds(ids=prompt[:30]),
                                           sampling=D.SamplingParams(temperature=0, max_tokens=150,
                                                                     ignore_eos=True)))
    got = 0
    for m in call:
        got += len(m.token_ids)
        if got >= 20:
            break
    call.cancel()
    s = wait_idle(stub)
    assert s.free_blocks == s.total_blocks
