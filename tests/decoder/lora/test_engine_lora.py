"""Adapters through the real engine (EngineCore + Runner + bank + registry + leases).

Stale KV after a reload under the same name, prefix sharing by content, slots swapped
beyond the slot count, and leases that always come back (finish, abort, preemption,
runner failure, n > 1, a request the runner refuses).
"""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from services.common.errors import AdapterInUse
from services.decoder.engine.step import SamplingParams, StepInput
from services.decoder.lora import adapter_request
from services.decoder.server.async_engine import AsyncEngine
from tests.decoder.lora.adapters import PINS, Spec, lora_engine, register, write_adapter
from tests.decoder.model.checkpoints import build
from tests.decoder.runner.driver import BlockAllocator, Seq

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 9, 14, 3, 77, 21, 8, 40, 41, 99, 3, 150, 12]      # 13 tokens: 3 full blocks of 4
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECS = [Spec(f"ad{i}", r, 2.0 * r, t, 20 + i) for i, (r, t) in enumerate(
    [(2, ("q_proj", "v_proj")), (4, ALL), (8, ("o_proj", "down_proj")), (1, ("k_proj", "up_proj")),
     (3, ("gate_proj", "q_proj"))])]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_lora")
    folder = build(root, "qwen2_gqa2_odd_tied")
    adapters = {s.name: write_adapter(folder, root / "adapters", s) for s in SPECS}
    adapters["zero"] = write_adapter(folder, root / "adapters", Spec("zero", 4, 8.0, ALL, 0), zero=True)
    return folder, adapters


def run_one(core, registry, rid, prompt, name, sampling=GREEDY):
    """Serve one request alone; returns (tokens, cached prompt tokens)."""
    adapter, keys = adapter_request(name, registry.status(name).digest) if name else (None, ())
    core.add_request(rid, prompt, sampling, extra_keys=keys, adapter=adapter)
    toks, cached = [], 0
    while core.has_unfinished():
        for out in core.step():
            assert out.finish_reason in (None, "length"), out
            toks.extend(out.new_token_ids)
            cached = out.num_cached_tokens
    return toks, cached


def test_zero_adapter_equals_base_exactly(base):
    folder, adapters = base
    # The slot bank's steps run the layers (the decode stack takes adapter rows of the CPU pool only), so the plain
    # steps are held to the layers too: the stack agrees with them within rounding, not bit for bit.
    core, registry = lora_engine(folder, fast_paths=f"{PINS},decode_stack=off")
    slot = register(registry, "zero", adapters["zero"]).slot
    alloc = BlockAllocator(128)
    mixed = [Seq("z", PROMPT, lora_slot=slot), Seq("b", PROMPT)]
    logits, _ = core.runner.logits(StepInput([s.chunk(13, alloc, 4) for s in mixed]))
    # Against the same step without the adapter, row for row: a GEMM need not give two equal rows
    # at different positions equal results (MKL's compatible mode does not), so row 0 vs row 1 would
    # test the BLAS, not the bank. A zero B adds exactly +0.
    plain = [Seq("z", PROMPT), Seq("b", PROMPT)]
    base_logits, _ = core.runner.logits(StepInput([s.chunk(13, BlockAllocator(128), 4) for s in plain]))
    assert torch.equal(logits[0], base_logits[0])
    assert run_one(core, registry, "1", PROMPT, "zero")[0] == run_one(core, registry, "2", PROMPT, None)[0]


def test_reload_under_same_name_never_serves_stale_kv(base):
    folder, adapters = base
    core, registry = lora_engine(folder, slots=1)
    ref_core, ref_reg = lora_engine(folder, slots=1)
    register(ref_reg, "only-b", adapters["ad1"])
    expected_b = run_one(ref_core, ref_reg, "ref", PROMPT, "only-b")[0]

    slot_a = register(registry, "name", adapters["ad0"]).slot
    out_a, cached = run_one(core, registry, "1", PROMPT, "name")
    assert cached == 0 and out_a != expected_b
    assert run_one(core, registry, "2", PROMPT, "name") == (out_a, 12)     # A's prefix is cached
    hits = core.stats().prefix_hits
    registry.unregister("name")
    assert register(registry, "name", adapters["ad1"]).slot == slot_a      # same name, same slot, other weights
    out_b, cached = run_one(core, registry, "3", PROMPT, "name")
    assert out_b == expected_b and cached == 0
    assert core.stats().prefix_hits == hits                                # none of A's blocks were hit
    assert run_one(core, registry, "4", PROMPT, "name") == (expected_b, 12)
    core.check_idle()


def test_same_weights_under_two_names_share_prefix_blocks(base):
    folder, adapters = base
    core, registry = lora_engine(folder)
    assert register(registry, "p", adapters["ad2"]).digest == register(registry, "q", adapters["ad2"]).digest
    out_p, cached = run_one(core, registry, "1", PROMPT, "p")
    assert cached == 0
    assert run_one(core, registry, "2", PROMPT, "q") == (out_p, 12)
    assert run_one(core, registry, "3", PROMPT, None)[1] == 0          # the base model does not share them
    assert registry.slots_in_use == 1


def drive(core, registry, workload, *, stagger=1, seed=0, abort_every=0, fail_step=None):
    """Run (rid, prompt, adapter, sampling) items: staggered arrivals, an abort of a random
    live request every `abort_every` steps, a failing runner at the
    first step from `fail_step` on that runs something.

    Returns ({rid: tokens}, whether an adapter request waited for a slot, finish reasons).
    Checks after every step that live leases equal the requests holding one.
    """
    rng = random.Random(seed)
    results = {rid: [] for rid, *_ in workload}
    reasons = set()
    pending, steps, waited, injected = list(workload), 0, False, False
    while pending or core.has_unfinished():
        if pending and steps % stagger == 0:
            rid, prompt, name, sampling = pending.pop(0)
            adapter, keys = adapter_request(name, registry.status(name).digest) if name else (None, ())
            core.add_request(rid, prompt, sampling, extra_keys=keys, adapter=adapter)
        if abort_every and steps % abort_every == abort_every - 1 and core._choices:
            core.abort(rng.choice(sorted(core._choices)))
        if fail_step is not None and steps >= fail_step and core.scheduler.running and not injected:
            injected = True
            core.inject_fault(core.num_steps + 1)      # this step's forward raises
        for out in core.step():
            results[out.request_id].extend(out.new_token_ids)
            reasons.add(out.finish_reason)
        holders = [r for r in core.scheduler.requests.values() if r.holds_lease and r.adapter is not None]
        assert registry.total_refs == len(holders)
        waited |= any(r.adapter is not None and not r.holds_lease for r in core.scheduler.waiting)
        steps += 1
        assert steps < 5000
    core.check_idle()
    assert registry.total_refs == 0 and all(e.refs == 0 for e in registry.entries.values())
    return results, waited, reasons - {None}


def test_more_adapters_than_slots_swap_correctly(base):
    folder, adapters = base
    rng = random.Random(3)
    names = [s.name for s in SPECS] + [None]
    prompts = [[rng.randrange(4, 160) for _ in range(rng.randrange(3, 15))] for _ in range(14)]
    workload = [(str(i), p, rng.choice(names), GREEDY) for i, p in enumerate(prompts)]

    # Truth: each request alone, with a slot for every adapter.
    ref_core, ref_reg = lora_engine(folder, slots=5)
    for s in SPECS:
        register(ref_reg, s.name, adapters[s.name])
    expected = {rid: run_one(ref_core, ref_reg, rid, p, n)[0] for rid, p, n, _ in workload}

    core, registry = lora_engine(folder, slots=2, cpu_loras=5, budget=6, max_seqs=6)
    for s in SPECS:
        register(registry, s.name, adapters[s.name])
    results, waited, _ = drive(core, registry, workload)
    assert results == expected
    assert registry.num_evictions > 0 and waited      # adapters really were swapped, requests really waited
    assert len({n for _, _, n, _ in workload if n}) > 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_leases_return_after_finish_abort_preemption_and_failure(base, seed):
    folder, adapters = base
    rng = random.Random(seed)
    names = [s.name for s in SPECS[:3]] + [None]
    workload = []
    for i in range(12):
        sampling = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randrange(2, 13),
                                  ignore_eos=True, n=rng.choice([1, 1, 2]), seed=i)
        workload.append((str(i), [rng.randrange(4, 160) for _ in range(rng.randrange(2, 14))],
                         rng.choice(names), sampling))
    # A small KV pool forces preemption; budget and seats keep several adapters running at once.
    core, registry = lora_engine(folder, slots=2, cpu_loras=4, num_blocks=10, budget=8, max_seqs=5,
                                 prefix_caching=bool(seed % 2))
    for s in SPECS[:3]:
        register(registry, s.name, adapters[s.name])
    _, _, reasons = drive(core, registry, workload, seed=seed, abort_every=9, fail_step=14)
    assert core.stats().num_preemptions > 0
    assert "abort" in reasons and "error" in reasons


def test_unload_refused_while_leased_and_each_choice_leases(base):
    folder, adapters = base
    core, registry = lora_engine(folder)
    register(registry, "x", adapters["ad0"])
    adapter, keys = adapter_request("x", registry.status("x").digest)
    core.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=4, n=3, ignore_eos=True),
                     extra_keys=keys, adapter=adapter)
    seen = 0
    while core.has_unfinished():
        core.step()
        seen = max(seen, registry.status("x").refs)
        if registry.status("x").refs:
            with pytest.raises(AdapterInUse):
                registry.unregister("x")
    assert seen == 3                      # one lease per choice
    assert registry.status("x").refs == 0
    registry.unregister("x")
    core.check_idle()


def test_a_request_past_validation_fails_alone_and_the_engine_serves_on(base):
    """A token id outside the vocabulary that got past every check (straight into an engine that was
    not told the vocabulary) fails only its own request: the requests of its step, with an adapter or
    without, get the tokens they get alone, the AsyncEngine stays up for the next requests, and every
    KV block and adapter lease comes back."""
    folder, adapters = base
    core, registry = lora_engine(folder)
    register(registry, "ad1", adapters["ad1"])
    vocab = core.runner.vocab_size
    bad_prompt = PROMPT[:5] + [vocab + 3] + PROMPT[6:]
    alone = {name: run_one(core, registry, f"alone-{name}", PROMPT, name)[0] for name in (None, "ad1")}

    def add(rid, prompt, name):
        adapter, keys = adapter_request(name, registry.status(name).digest) if name else (None, ())
        core.add_request(rid, prompt, GREEDY, extra_keys=keys, adapter=adapter)

    # In the core: all three share the first step, and only the bad one ends there, with its error.
    for rid, prompt, name in (("base", PROMPT, None), ("bad", bad_prompt, "ad1"), ("lora", PROMPT, "ad1")):
        add(rid, prompt, name)
    first = {o.request_id: o for o in core.step()}
    assert core.step_error is None and first["bad"].finish_reason == "error"
    assert "token ids must be in" in first["bad"].error and registry.total_refs == 1    # "lora" holds its own
    got = {"base": first["base"].new_token_ids, "lora": first["lora"].new_token_ids}
    while core.has_unfinished():
        for out in core.step():
            got[out.request_id].extend(out.new_token_ids)
    assert got == {"base": alone[None], "lora": alone["ad1"]}
    core.check_idle()
    assert registry.total_refs == 0

    # Through the AsyncEngine: the bad request's stream ends with the error, the engine stays alive.
    engine = AsyncEngine(core)

    async def generate(rid, prompt, name):
        adapter, keys = adapter_request(name, registry.status(name).digest) if name else (None, ())
        outs = [o async for o in engine.generate(rid, prompt, GREEDY, extra_keys=keys, adapter=adapter)]
        return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason

    async def serve():
        engine.start()
        try:
            together = await asyncio.gather(generate("a-base", PROMPT, None), generate("a-bad", bad_prompt, "ad1"),
                                            generate("a-lora", PROMPT, "ad1"))
            alive = engine.alive
            after = await asyncio.gather(generate("b-base", PROMPT, None), generate("b-lora", PROMPT, "ad1"))
            return together, alive, after
        finally:
            engine.stop()
    together, alive, after = asyncio.run(serve())
    assert alive and engine.failed is None
    assert together == [(alone[None], "length"), ([], "error"), (alone["ad1"], "length")]
    assert after == [(alone[None], "length"), (alone["ad1"], "length")]
    core.check_idle()
    assert registry.total_refs == 0 and all(e.refs == 0 for e in registry.entries.values())
