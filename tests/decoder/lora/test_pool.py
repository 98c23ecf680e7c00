"""The CPU adapter pool: rank rows in per-kind arenas under a byte budget (lora/pool.py).

Unit cases for placing (first fit, compaction, growth, the budget, mixed ranks, reused handles)
and a random sequence checked against what must always hold; the registry evicting idle adapters
until one fits; the pool's forward against the slot bank's torch path on the same adapters; and
64 requests on 64 distinct adapters in one batch against peft.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from services.common.errors import InvalidArgument, Overloaded
from services.common.plan import DECODER, ExecutionPlan
from services.decoder.engine.scheduler import LEASE_PATIENCE
from services.decoder.engine.step import SamplingParams, StepInput
from services.decoder.kernels import lora_cpu
from services.decoder.lora import (
    TARGETS,
    AdapterBank,
    AdapterPool,
    AdapterRegistry,
    adapter_request,
    prepare_weights,
)
from services.decoder.lora.pool import step_rows
from services.decoder.model.loader import load_model
from services.decoder.server.config import DecoderConfig
from tests.decoder.lora.adapters import (
    Spec,
    assert_distinct_batch_equals_peft,
    lora_engine,
    peft_mixed,
    register,
    write_adapter,
)
from tests.decoder.lora.test_engine_lora import drive, run_one
from tests.decoder.lora.test_registry import NAMES, RegistryMachine
from tests.decoder.model.checkpoints import TINY_SHAPE, build
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close, is_close

ATTN, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("pool"), "llama_mha_untied")


def make_weights(pool, seed, rank, kinds, layers=None):
    """Random effective weights of `rank` on the modules of `kinds` (only decoder layers `layers`)."""
    gen = torch.Generator().manual_seed(seed)
    raw = {}
    for name, (fan_in, fan_out) in pool.shapes.items():
        if name.rsplit(".", 1)[-1] in kinds and (layers is None or any(f".layers.{i}." in name for i in layers)):
            raw[name] = (torch.randn(rank, fan_in, generator=gen), 0.1 * torch.randn(fan_out, rank, generator=gen))
    return prepare_weights(raw, layers=pool.shapes, max_rank=pool.max_rank, dtype=pool.dtype, alpha=float(rank))


def holds(pool, handle, weights):
    """True when `handle` reads back exactly `weights`: zero rows for the modules of its kinds it leaves out."""
    got = pool.read(handle)
    kinds = set(weights.targets)
    if {n.rsplit(".", 1)[-1] for n in got} != kinds:
        return False
    for name, (a, b) in got.items():
        want = weights.modules.get(name)
        if want is None:
            if a.any() or b.any():
                return False
        elif not (torch.equal(a, want[0]) and torch.equal(b, want[1])):
            return False
    return True


def check(pool, live):
    """What always holds: every placed adapter reads back exactly, extents of a kind are disjoint and
    inside its capacity, the bytes add up and the arenas fit the budget."""
    assert set(pool.placed) == set(live)
    for handle, w in live.items():
        assert holds(pool, handle, w)
    for rows in pool.kinds.values():
        spans = sorted(rows.extents.values())
        assert all(o + r <= nxt for (o, r), (nxt, _) in zip(spans, spans[1:], strict=False))
        assert all(o + r <= rows.capacity for o, r in spans)
        assert all(layer.A.shape[0] == layer.Bt.shape[0] == rows.capacity for layer in rows.layers)
    assert pool.used_bytes == sum(pool.footprint(w) for w in live.values()) <= pool.budget
    assert pool.nbytes <= pool.budget


def test_place_read_free_mixed_ranks_and_reused_handles(model_folder):
    pool = AdapterPool(load_model(model_folder), budget_bytes=2**22)
    ws = [make_weights(pool, 1, 4, ("q_proj", "v_proj")), make_weights(pool, 2, 8, TARGETS, layers=[1]),
          make_weights(pool, 3, 16, MLP)]
    live = {pool.place(w): w for w in ws}
    assert list(live) == [0, 1, 2]
    check(pool, live)
    # Ranks are not padded: each kind holds exactly the ranks of the adapters covering it.
    assert pool.kinds[TARGETS.index("q_proj")].used == 12 and pool.kinds[TARGETS.index("down_proj")].used == 24
    assert pool.kinds[TARGETS.index("k_proj")].used == 8
    pool.free(1)
    del live[1]
    assert not pool.valid(1) and pool.valid(0) and pool.valid(2)
    w4 = make_weights(pool, 4, 2, ("k_proj",))
    assert pool.place(w4) == 1                       # the lowest free handle again
    live[1] = w4
    check(pool, live)
    with pytest.raises(ValueError, match="not placed"):
        pool.free(7)


def test_first_fit_compaction_and_growth(model_folder):
    pool = AdapterPool(load_model(model_folder), targets=("q_proj",), budget_bytes=2**22)
    q = pool.kinds[TARGETS.index("q_proj")]
    ws = [make_weights(pool, s, 4, ("q_proj",)) for s in range(6)]
    live = {}
    for i in range(4):
        before = pool.arenas()[0][0][0]
        live[pool.place(ws[i])] = ws[i]
        assert pool.arenas()[0][0][0] is not before           # grew: 4, 8, 16, 16 rows... (replaced)
        if i == 2:
            break
    assert q.capacity == 16 and pool.version == 3
    live[pool.place(ws[3])] = ws[3]                              # fits at 12: no move, no new tensors
    assert q.capacity == 16 and pool.version == 3 and q.extents[3] == (12, 4)
    for h in (0, 2):
        pool.free(h)
        del live[h]
    # Gaps [0, 4) and [8, 12): first fit puts rank 4 in the first one.
    live[pool.place(ws[4])] = ws[4]
    assert q.extents[0] == (0, 4) and pool.version == 3
    pool.free(0)
    del live[0]
    # 8 free rows but no gap of 8: compacted in place (same tensors), then placed at the end.
    a = pool.arenas()[1][0][0]
    big = make_weights(pool, 9, 8, ("q_proj",))
    live[pool.place(big)] = big
    assert pool.version == 4 and pool.arenas()[1][0][0] is a and q.capacity == 16
    assert sorted(q.extents.values()) == [(0, 4), (4, 4), (8, 8)]
    check(pool, live)


def test_budget_refusal_and_arenas_within_budget(model_folder):
    probe = AdapterPool(load_model(model_folder), budget_bytes=2**30)
    unit = probe.footprint(make_weights(probe, 0, 4, TARGETS))
    pool = AdapterPool(load_model(model_folder), budget_bytes=3 * unit)
    live = {}
    for s in range(3):
        w = make_weights(pool, s, 4, TARGETS)
        live[pool.place(w)] = w
    assert pool.place(make_weights(pool, 5, 1, ("q_proj",))) is None     # budget spent
    check(pool, live)
    assert pool.refusal(make_weights(pool, 6, 16, TARGETS)) is not None  # 4 units: never fits
    assert pool.refusal(make_weights(pool, 6, 12, TARGETS)) is None
    # All of one kind, then all of another: the first kind's spare rows are given back.
    for kind, seed in (("q_proj", 10), ("down_proj", 40)):
        for h in list(live):
            pool.free(h)
        live = {}
        rows = pool.footprint(make_weights(pool, 0, 1, (kind,)))
        for s in range(3 * unit // rows // 4):
            w = make_weights(pool, seed + s, 4, (kind,))
            live[pool.place(w)] = w
            check(pool, live)


def test_random_place_and_free_keep_every_adapter_intact(model_folder):
    probe = AdapterPool(load_model(model_folder), budget_bytes=2**30)
    pool = AdapterPool(load_model(model_folder), budget_bytes=6 * probe.footprint(make_weights(probe, 0, 8, TARGETS)))
    rng = random.Random(0)
    kinds = [("q_proj", "v_proj"), TARGETS, MLP, ("o_proj",), ("k_proj", "down_proj")]
    live = {}
    for step in range(150):
        if live and rng.random() < 0.4:
            h = rng.choice(sorted(live))
            pool.free(h)
            del live[h]
        else:
            w = make_weights(pool, step, rng.randint(1, 16), rng.choice(kinds))
            fits = pool.used_bytes + pool.footprint(w) <= pool.budget
            h = pool.place(w)
            assert (h is not None) == fits
            if h is not None:
                assert h == min(set(range(len(live) + 1)) - set(live))
                live[h] = w
        check(pool, live)
    assert pool.version > 0


def test_step_rows_and_activate(model_folder):
    pool = AdapterPool(load_model(model_folder), budget_bytes=2**22)
    h0 = pool.place(make_weights(pool, 1, 4, ("q_proj", "v_proj")))
    h1 = pool.place(make_weights(pool, 2, 8, ("q_proj", "down_proj")))
    with pool.activate([(0, 2, h1), (3, 1, h0)], 5) as step:
        q, v, down = (TARGETS.index(t) for t in ("q_proj", "v_proj", "down_proj"))
        assert step.ranks[q].tolist() == [8, 8, 0, 4, 0] and step.ranks[v].tolist() == [0, 0, 0, 4, 0]
        assert step.offsets[q].tolist() == [4, 4, 0, 0, 0] and step.ranks[down].tolist() == [8, 8, 0, 0, 0]
        assert step.offsets.dtype == step.ranks.dtype == torch.int32 and step.offsets.shape == (7, 5)
        assert step.active == tuple(t in (q, v, down) for t in range(7))
        with pytest.raises(RuntimeError, match="twice"):
            with pool.activate([(0, 1, h0)], 1):
                pass
    assert pool.step.offsets is None and not any(pool.step.active)
    with pytest.raises(ValueError, match="not placed"):
        step_rows([(0, 1, 5)], 1, pool._rows_of)


@pytest.mark.parametrize("split,ahead", [("auto", "auto"), ("coarse", "off"), ("fine", "burst"), ("fine", "paced")])
def test_the_reading_is_timed_unless_pinned_and_reaches_the_operator(model_folder, split, ahead):
    pool = AdapterPool(load_model(model_folder), budget_bytes=2**22)
    record = ExecutionPlan(f"lora_split={split},lora_prefetch={ahead}", DECODER)
    grain, prefetch = pool.choose_reading(record)
    chosen = record.get("lora_split"), record.get("lora_prefetch")
    assert grain == pool.grain == lora_cpu.GRAINS[chosen[0].chosen] == pool.step.rows.keywords["grain"]
    assert prefetch == pool.prefetch == lora_cpu.PREFETCH[chosen[1].chosen] == pool.step.rows.keywords["prefetch"]
    for choice, pin, candidates, rows in zip(chosen, (split, ahead), (lora_cpu.GRAINS, lora_cpu.PREFETCH),
                                             (lora_cpu.TIMING_ROWS, lora_cpu.PREFETCH_ROWS), strict=True):
        if pin == "auto":
            assert {t.candidate for t in choice.timings} == set(candidates) and not choice.reason
            assert {t.rows for t in choice.timings} == {rows}
        else:
            assert choice.chosen == pin and not choice.timings and "pinned" in choice.reason


def test_rows_in_torch_keep_the_coarse_grain_and_the_prefetch(model_folder):
    pool = AdapterPool(load_model(model_folder), budget_bytes=2**22)
    pool.backend, pool.step.rows = "torch", lora_cpu.lora_rows_torch      # as where the operator cannot be built
    record = ExecutionPlan("lora_split=fine,lora_prefetch=off", DECODER)
    assert pool.choose_reading(record) == (lora_cpu.GRAINS["coarse"], lora_cpu.PREFETCH["paced"])
    assert pool.step.rows is lora_cpu.lora_rows_torch
    assert "torch" in record.get("lora_split").reason and "torch" in record.get("lora_prefetch").reason


def test_cpu_registry_may_hold_fewer_adapters_than_max_loras(model_folder):
    """On CPU --max-loras only turns LoRA on (the pool has bytes, not slots), so --max-cpu-loras below it is a
    valid config and the registry counts --max-cpu-loras alone; where slots exist (CUDA's bank) each slot needs
    a registered adapter to fill it, and both the config and the registry refuse fewer."""
    cfg = DecoderConfig(model="m", max_loras=8, max_cpu_loras=2)
    registry = AdapterRegistry(AdapterPool(load_model(model_folder)), cfg.max_cpu_loras)
    for i, name in enumerate("ab"):
        registry.register(name, make_weights(registry.bank, i, 4, TARGETS))
    with pytest.raises(Overloaded, match="--max-cpu-loras"):
        registry.register("c", make_weights(registry.bank, 2, 4, TARGETS))
    with pytest.raises(ValueError, match="max_cpu_loras \\(2\\) must be at least max_loras \\(8\\) on cuda"):
        DecoderConfig(model="m", device="cuda", max_loras=8, max_cpu_loras=2)
    with pytest.raises(ValueError, match="at least the slot count"):
        AdapterRegistry(AdapterBank(load_model(model_folder), num_slots=8, max_rank=4), 2)


def test_registry_evicts_idle_adapters_until_one_fits(model_folder):
    probe = AdapterPool(load_model(model_folder), budget_bytes=2**30)
    unit = probe.footprint(make_weights(probe, 0, 4, TARGETS))
    registry = AdapterRegistry(AdapterPool(load_model(model_folder), budget_bytes=3 * unit), max_cpu_loras=8)
    pool = registry.bank
    ws = {n: make_weights(pool, i, 4, TARGETS) for i, n in enumerate("abc")}
    ws["big"] = make_weights(pool, 9, 8, TARGETS)        # two units
    for n, w in ws.items():
        registry.register(n, w)
    assert [registry.status(n).slot for n in ("a", "b", "c", "big")] == [0, 1, 2, -1]   # no eviction at register
    with pytest.raises(InvalidArgument, match="more than the whole adapter pool"):
        registry.register("huge", make_weights(pool, 10, 16, TARGETS))
    ha, hb = registry.acquire("a", ws["a"].digest), registry.acquire("b", ws["b"].digest)
    # Only c is idle: evicting it leaves one unit, too little, so nothing is evicted and big waits.
    assert registry.acquire("big", ws["big"].digest) is None
    assert registry.num_evictions == 0 and registry.status("c").slot == 2
    registry.release("a", ha)
    registry.acquire("c", ws["c"].digest)
    registry.release("c", registry.status("c").slot)
    # a (released before c was leased again) goes first, then c; b stays leased and intact.
    hbig = registry.acquire("big", ws["big"].digest)
    assert hbig is not None and registry.num_evictions == 2
    assert registry.status("a").slot == registry.status("c").slot == -1
    assert holds(pool, hb, ws["b"]) and holds(pool, hbig, ws["big"])
    registry.release("b", hb)
    registry.release("big", hbig)
    assert registry.total_refs == 0 and registry.slots_in_use == 2


# -- through the runner and the engine ----------------------------------------------------------

RANKED = [Spec(f"m{i}", r, 2.0 * r, t, 50 + i) for i, (r, t) in enumerate(
    [(3, ("q_proj", "v_proj")), (16, TARGETS), (8, ("o_proj", "down_proj")), (5, ("k_proj", "gate_proj", "up_proj"))])]


@pytest.fixture(scope="module")
def ranked(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool_ranked")
    folder = build(root, "qwen2_gqa2_odd_tied")
    return folder, {s.name: write_adapter(folder, root / "adapters", s) for s in RANKED}


# The matmul path pinned, as in test_peft_reference: timed at load (auto), a loaded machine once gave base rows
# of the mixed step that differed from the adapter-free step's in the last bits.
@pytest.mark.numerics
@pytest.mark.parametrize("rows", ["operator", "torch"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pool_forward_matches_bank(ranked, dtype, rows):
    """Mixed ranks, prefill chunks and single rows, base rows: the pool's rows (the C++ operator, or its torch
    form where the operator cannot be built) against the bank's slots."""
    folder, adapters = ranked
    results = []
    for pool_bytes in (None, 2**24):
        core, registry = lora_engine(folder, slots=4, max_rank=16, pool_bytes=pool_bytes, dtype=dtype,
                                     fast_paths="screen=on,linear=plain")
        if pool_bytes and rows == "torch":
            registry.bank.step.rows = lora_cpu.lora_rows_torch
        handles = {n: register(registry, n, f).slot for n, f in adapters.items()}
        rows = ["m1", None, "m0", "m2", "m3", None, "m1"]
        torch.manual_seed(3)
        lengths = [9, 5, 1, 7, 9, 1, 3]
        seqs = [Seq(str(i), torch.randint(4, 150, (n,)).tolist(), lora_slot=None if a is None else handles[a])
                for i, (a, n) in enumerate(zip(rows, lengths, strict=True))]
        alloc = BlockAllocator(128)      # one per step: sequences must not share blocks
        got, _ = core.runner.logits(StepInput([s.chunk(9, alloc, 4) for s in seqs]))
        plain = [Seq(str(i), s.tokens) for i, s in enumerate(seqs)]
        alloc = BlockAllocator(128)
        alone, _ = core.runner.logits(StepInput([s.chunk(9, alloc, 4) for s in plain]))
        for i in (1, 5):
            assert torch.equal(got[i], alone[i])          # base rows: exactly the step without adapters
        assert not any(is_close(got[i], alone[i], dtype=got.dtype, **TINY_SHAPE) for i in (0, 2, 3, 4, 6))
        results.append(got.float().clone())
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    assert_close(results[1], results[0], dtype=torch_dtype, **TINY_SHAPE)


def test_pool_swaps_under_a_small_budget(ranked):
    """More adapters than the budget holds: idle ones are evicted, requests wait, tokens stay right."""
    folder, adapters = ranked
    rng = random.Random(5)
    names = [s.name for s in RANKED] + [None]
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    workload = [(str(i), [rng.randrange(4, 160) for _ in range(rng.randrange(3, 12))], rng.choice(names), greedy)
                for i in range(12)]
    ref_core, ref_reg = lora_engine(folder, max_rank=16, pool_bytes=2**24)
    for n, f in adapters.items():
        register(ref_reg, n, f)
    expected = {rid: run_one(ref_core, ref_reg, rid, p, n, greedy)[0] for rid, p, n, _ in workload}
    largest = max(ref_reg.bank.footprint(ref_reg.entries[n].weights) for n in adapters)
    core, registry = lora_engine(folder, max_rank=16, pool_bytes=largest + largest // 4, budget=6, max_seqs=6)
    for n, f in adapters.items():
        register(registry, n, f)
    results, waited, _ = drive(core, registry, workload)
    assert results == expected
    assert registry.num_evictions > 0 and waited


def test_a_busy_adapter_cannot_keep_a_cold_one_out(ranked):
    """Room for one adapter, and a new request on the resident one arrives every step: the cold adapter's
    request lets later ones pass LEASE_PATIENCE times, then no one overtakes it, the busy adapter goes idle
    and is evicted for it."""
    folder, adapters = ranked
    _, probe = lora_engine(folder, max_rank=16, pool_bytes=2**24)
    for n in ("m1", "m2"):
        register(probe, n, adapters[n])
    room = max(probe.bank.footprint(probe.entries[n].weights) for n in ("m1", "m2"))     # one of them at a time
    core, registry = lora_engine(folder, max_rank=16, budget=64, max_seqs=8, pool_bytes=room)
    busy, cold = (register(registry, n, adapters[n]).digest for n in ("m1", "m2"))
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = itertools.count()

    def add(name: str, digest: str) -> str:
        rid = str(next(ids))
        adapter, keys = adapter_request(name, digest)
        core.add_request(rid, [5, 6, 7], greedy, extra_keys=keys, adapter=adapter)
        return rid

    add("m1", busy)
    core.step()
    waiting, done, steps = add("m2", cold), set(), 0
    while waiting not in done and steps < 400:
        done |= {o.request_id for o in core.step() if o.finished}
        steps += 1
        add("m1", busy)
    assert waiting in done, "the cold adapter's request never ran"
    assert LEASE_PATIENCE < steps < LEASE_PATIENCE + 20 and registry.num_evictions >= 1


# 64 distinct adapters: ranks 4..16, attention, MLP and both.
MANY = [Spec(f"d{i:02d}", 4 + i % 13, float(8 + i % 5), (ATTN, MLP, TARGETS, ("q_proj", "v_proj", "down_proj"))[i % 4],
             100 + i) for i in range(64)]


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """(base folder, the 64 MANY adapters' folders, peft holding them all)."""
    root = tmp_path_factory.mktemp("pool64")
    folder = build(root, "llama_mha_untied")
    folders = {s.name: write_adapter(folder, root / "adapters", s) for s in MANY}
    return folder, folders, peft_mixed(folder, folders)


@pytest.mark.numerics
@pytest.mark.parametrize("stack,split,ahead",
                         [("on", "coarse", "off"), ("on", "fine", "paced"), ("off", "fine", "burst")])
def test_64_distinct_adapters_in_one_batch_match_peft(many, stack, split, ahead):
    """With the C++ decode stack pinned on, decode steps with adapter rows run in it (counted); pinned off,
    in the model's layers: both match peft, with either grain of the adapter rows (lora_split), asking for them
    ahead each way (lora_prefetch)."""
    folder, folders, peft = many
    core, registry = lora_engine(
        folder, max_rank=16, pool_bytes=2**26, cpu_loras=64, num_blocks=1024, budget=512, max_seqs=64,
        fast_paths=f"screen=on,attention=cpp,decode_stack={stack},lora_split={split},lora_prefetch={ahead}")
    assert core.runner.plan.chosen("lora_split") == split and core.runner.plan.chosen("lora_prefetch") == ahead
    fused = core.runner.fused_decode
    assert (fused is not None) == (stack == "on")
    stacked = []
    if fused is not None:
        fused.max_rows = 64         # the pin's largest timing row count may be below the batch
        run = fused._run
        fused._run = lambda *a: (stacked.append(a[-1] is not None), run(*a))[1]
    assert_distinct_batch_equals_peft(core, registry, folders, peft, new_tokens=4)
    assert (stack == "on") == (sum(stacked) >= 3)       # every decode step after the prefill, with adapters


# -- the registry over the pool: random calls, what must always hold ----------------------------------

class PoolRegistryMachine(RegistryMachine):
    """test_registry's machine over a pool that holds about two of its adapters (ranks 1..3, so one
    eviction may or may not make room): None from acquire only when even every idle adapter gone would
    not; a leased adapter always reads back exactly; the pool within its budget."""

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        probe = AdapterPool(load_model(POOL_MODEL[0]), budget_bytes=2**30)
        unit = probe.footprint(make_weights(probe, 0, 1, ("q_proj", "down_proj")))
        self.reg = AdapterRegistry(AdapterPool(load_model(POOL_MODEL[0]), budget_bytes=5 * unit, max_rank=4),
                                   max_cpu_loras=4)
        self.weights = [make_weights(self.reg.bank, s, 1 + s % 3, ("q_proj", "down_proj")) for s in range(4)]
        self.leases = []

    @rule(name=st.sampled_from(NAMES))
    def acquire(self, name):
        entry = self.reg.entries.get(name)
        if entry is None:
            return
        before = dict(self.reg.resident)
        idle = [h for h, r in self.reg.residents.items() if r.refs == 0]
        slot = self.reg.acquire(name, entry.digest)
        if slot is None:
            assert not self.reg.bank.would_fit(entry.weights, idle) and self.reg.resident == before
        else:
            self.leases.append((name, slot, entry.digest))

    def holds(self, slot, weights) -> bool:
        return holds(self.reg.bank, slot, weights)

    def store_agrees(self) -> bool:
        return set(self.reg.residents) == set(self.reg.bank.placed)

    @invariant()
    def within_budget(self):
        reg = self.reg
        assert reg.bank.used_bytes <= reg.bank.budget and reg.bank.nbytes <= reg.bank.budget


POOL_MODEL: list = []


def test_registry_over_pool_state_machine(model_folder):
    POOL_MODEL[:] = [model_folder]
    PoolRegistryMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                                     suppress_health_check=list(HealthCheck))
    PoolRegistryMachine.TestCase().runTest()
