"""The registry's slots and leases, without a forward pass: unit cases and a state machine.

The hypothesis machine drives random register / unregister / acquire / release calls
against 2 slots and up to 5 names, and after every call checks what must always hold:
ref counts equal the live leases, a leased slot holds exactly its lease's weights (so it
was never overwritten), content sits in at most one slot, and failed calls change nothing.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.common.errors import AdapterInUse, AdapterNotFound, InvalidArgument, Overloaded
from services.decoder.lora import AdapterBank, AdapterRegistry, prepare_weights
from services.decoder.model.loader import load_model
from tests.decoder.model.checkpoints import build

NAMES = ("a", "b", "c", "d", "e")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("registry"), "llama_mha_untied")


def make_weights(bank, seed, rank=2, scale=0.1):
    gen = torch.Generator().manual_seed(seed)
    raw = {}
    for name, (fan_in, fan_out) in bank.shapes.items():
        if name.endswith(("q_proj", "down_proj")):
            raw[name] = (torch.randn(rank, fan_in, generator=gen), scale * torch.randn(fan_out, rank, generator=gen))
    return prepare_weights(raw, layers=bank.shapes, max_rank=bank.max_rank, dtype=bank.dtype, alpha=2.0 * rank)


def slot_holds(bank, slot, weights):
    """True when `slot`'s buffers are exactly `weights`, zero-padded, zero elsewhere."""
    r = weights.rank
    for name, layer in bank.layers.items():
        a, b = weights.modules.get(name, (None, None))
        if a is None:
            if layer.lora_A[slot].any() or layer.lora_B[slot].any():
                return False
            continue
        if not (torch.equal(layer.lora_A[slot, :r], a) and torch.equal(layer.lora_B[slot, :, :r], b)
                and not layer.lora_A[slot, r:].any() and not layer.lora_B[slot, :, r:].any()):
            return False
    return True


@pytest.fixture
def registry(model_folder):
    return AdapterRegistry(AdapterBank(load_model(model_folder), num_slots=2, max_rank=4), max_cpu_loras=3)


def test_leases_refcount_and_refuse_replace_or_unload(registry):
    w1, w2 = make_weights(registry.bank, 1), make_weights(registry.bank, 2)
    assert registry.register("a", w1).slot == 0          # placed at once in an empty slot
    s1 = registry.acquire("a", w1.digest)
    s2 = registry.acquire("a", w1.digest)
    assert s1 == s2 == 0 and registry.status("a").refs == 2 and registry.total_refs == 2
    for attempt in (lambda: registry.register("a", w2), lambda: registry.unregister("a")):
        with pytest.raises(AdapterInUse, match="used by 2 active requests"):
            attempt()
    assert slot_holds(registry.bank, 0, w1)
    registry.release("a", 0)
    registry.release("a", 0)
    with pytest.raises(RuntimeError, match="released twice"):
        registry.release("a", 0)
    registry.register("a", w2)                            # idle now: replacing works, same slot reused
    assert registry.status("a").slot == 0 and slot_holds(registry.bank, 0, w2)
    registry.unregister("a")
    assert registry.slots_in_use == 0 and not registry.entries
    with pytest.raises(AdapterNotFound):
        registry.unregister("a")


def test_waiting_request_of_replaced_adapter_fails(registry):
    w1, w2 = make_weights(registry.bank, 1), make_weights(registry.bank, 2)
    registry.register("a", w1)
    registry.register("a", w2)
    with pytest.raises(AdapterNotFound, match="unloaded or replaced"):
        registry.acquire("a", w1.digest)      # admitted with w1's digest: must not run w2 under it


def test_lru_idle_slot_is_refilled_never_a_leased_one(registry):
    bank = registry.bank
    ws = {n: make_weights(bank, i) for i, n in enumerate("abc")}
    for n, w in ws.items():
        registry.register(n, w)
    assert [registry.status(n).slot for n in "abc"] == [0, 1, -1]     # c registered on the host only
    sa, sb = registry.acquire("a", ws["a"].digest), registry.acquire("b", ws["b"].digest)
    assert registry.acquire("c", ws["c"].digest) is None              # both slots leased: wait
    assert slot_holds(bank, sa, ws["a"]) and slot_holds(bank, sb, ws["b"])
    registry.release("a", sa)
    assert registry.acquire("c", ws["c"].digest) == sa               # a's idle slot refilled
    assert registry.num_evictions == 1 and registry.status("a").slot == -1
    assert slot_holds(bank, sa, ws["c"]) and slot_holds(bank, sb, ws["b"])
    registry.release("b", sb)
    registry.release("c", sa)
    # LRU: b was leased before c, so b's slot goes when a comes back.
    assert registry.acquire("a", ws["a"].digest) == sb
    with pytest.raises(Overloaded, match="registry is full"):
        registry.register("d", make_weights(bank, 9))


def test_same_content_shares_one_slot(registry):
    w = make_weights(registry.bank, 5)
    registry.register("a", w)
    registry.register("b", make_weights(registry.bank, 5))
    assert registry.status("a").digest == registry.status("b").digest and registry.status("b").slot == 0
    assert registry.slots_in_use == 1
    registry.unregister("a")                   # b still needs the content
    assert registry.status("b").slot == 0 and slot_holds(registry.bank, 0, w)


def test_bad_names_refused(registry):
    for bad in ("", " x", "a b", "x" * 200, "../x"):
        with pytest.raises(InvalidArgument, match="adapter name"):
            registry.register(bad, make_weights(registry.bank, 1))
    assert not registry.entries


class RegistryMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.reg = AdapterRegistry(AdapterBank(load_model(MODEL[0]), num_slots=2, max_rank=4), max_cpu_loras=4)
        # Weight sets 0..3 (two names may get the same set: shared content).
        self.weights = [make_weights(self.reg.bank, s, rank=1 + s % 3) for s in range(4)]
        self.leases: list[tuple[str, int, str]] = []     # (name, slot, digest)

    @rule(name=st.sampled_from(NAMES), which=st.integers(0, 3))
    def register(self, name, which):
        entry = self.reg.entries.get(name)
        try:
            self.reg.register(name, self.weights[which])
        except AdapterInUse:
            assert entry is not None and entry.refs > 0
        except Overloaded:
            assert entry is None and len(self.reg.entries) == 4

    @rule(name=st.sampled_from(NAMES))
    def unregister(self, name):
        entry = self.reg.entries.get(name)
        try:
            self.reg.unregister(name)
        except AdapterInUse:
            assert entry.refs > 0
        except AdapterNotFound:
            assert entry is None

    @rule(name=st.sampled_from(NAMES))
    def acquire(self, name):
        entry = self.reg.entries.get(name)
        if entry is None:
            return
        leased_slots = {s for _, s, _ in self.leases}
        slot = self.reg.acquire(name, entry.digest)
        if slot is None:       # only when every slot is leased by other content
            assert len(leased_slots) == self.reg.bank.num_slots
            assert entry.digest not in {d for _, _, d in self.leases}
        else:
            self.leases.append((name, slot, entry.digest))

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        name, slot, _ = self.leases.pop(i % len(self.leases))
        self.reg.release(name, slot)

    def holds(self, slot, weights) -> bool:
        """Whether the store reads `weights` back exactly at `slot` (the pool's machine reads its own way)."""
        return slot_holds(self.reg.bank, slot, weights)

    @invariant()
    def consistent(self):
        reg = self.reg
        for slot, held in reg.residents.items():
            assert held.refs == sum(s == slot for _, s, _ in self.leases)
        for name, entry in reg.entries.items():
            assert entry.refs == sum(n == name for n, _, _ in self.leases)
        for name, slot, digest in self.leases:
            w = reg.entries[name].weights
            assert w.digest == digest and reg.resident[digest] == slot and self.holds(slot, w)
        assert len(reg.resident) == len(set(reg.resident.values())) == reg.slots_in_use
        assert all(reg.residents[s].digest == d for d, s in reg.resident.items())
        assert self.store_agrees()

    def store_agrees(self) -> bool:
        """Whether the store holds exactly the registry's residents (the pool's machine asks its own way)."""
        reg = self.reg
        return all(reg.bank.filled[s] == (s in reg.residents) for s in range(reg.bank.num_slots))


MODEL: list = []


def test_registry_state_machine(model_folder):
    MODEL[:] = [model_folder]
    RegistryMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                                 suppress_health_check=list(HealthCheck))
    RegistryMachine.TestCase().runTest()
