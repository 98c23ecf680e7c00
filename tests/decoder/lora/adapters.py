"""Real PEFT adapters for tests: peft 0.21 writes them, with random non-zero lora_B.

peft initialises lora_B to zero (the adapter starts as the identity); the tests
overwrite A and B with random values before saving so every adapter changes the
logits and a wrong slot, scale or target would show.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from services.decoder.engine.config import EngineConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.lora import AdapterBank, AdapterLeases, AdapterPool, AdapterRegistry, load_peft
from services.decoder.runner.runner import Runner
from tests.decoder.model.checkpoints import load_reference


@dataclass(frozen=True)
class Spec:
    name: str
    r: int
    alpha: float
    targets: tuple[str, ...]
    seed: int
    extra: dict = field(default_factory=dict)


# Three adapters of different ranks, alphas and target sets.
SPECS = (
    Spec("alpha", 4, 8.0, ("q_proj", "v_proj"), 1),
    Spec("beta", 8, 4.0, ("q_proj", "k_proj", "v_proj", "o_proj"), 2),
    Spec("gamma", 2, 2.0, ("gate_proj", "up_proj", "down_proj", "o_proj"), 3),
)


def write_adapter(base_folder: Path, out: Path, spec: Spec, scale: float = 0.3, zero: bool = False) -> Path:
    """Save a peft LoRA adapter for the checkpoint in base_folder under out/spec.name."""
    model = load_reference(base_folder)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0,
                        **spec.extra)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.zeros_like(p) if zero else scale * torch.randn(p.shape, generator=gen))
    folder = out / spec.name
    peft_model.save_pretrained(folder)
    return folder


def peft_mixed(base_folder: Path, folders: dict[str, Path]) -> PeftModel:
    """One PeftModel holding every adapter (for adapter_names=[...] mixed batches)."""
    names = list(folders)
    model = PeftModel.from_pretrained(load_reference(base_folder), folders[names[0]], adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(folders[n], adapter_name=n)
    return model.eval()


def lora_engine(base_folder: Path, *, slots: int = 4, max_rank: int = 8, cpu_loras: int = 8,
                targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                block_size: int = 4, num_blocks: int = 128, budget: int = 64, max_seqs: int = 8,
                prefix_caching: bool = True, speculative=None, device: str = "cpu",
                fast_paths: str = "screen=on,speculation=always", pool_bytes: int | None = None, dtype: str = "fp32"
                ) -> tuple[EngineCore, AdapterRegistry]:
    """EngineCore + Runner with an adapter store, registry and leases (no adapters yet): the slot bank, or
    with pool_bytes the CPU pool of that budget; fast_paths: the CPU runner's pins (off CPU none: the
    screen is CPU-only); speculation drafts always, so a test that checks drafts change no token sees
    drafts whatever the load-time gate would decide on a busy machine."""
    runner = Runner.from_folder(base_folder, dtype, block_size, num_blocks, device,
                                fast_paths=fast_paths if device == "cpu" else "")
    if pool_bytes is None:
        bank = AdapterBank(runner.model, targets, slots, max_rank)
    else:
        bank = AdapterPool(runner.model, targets, pool_bytes, max_rank)
    runner.attach_lora(bank)
    registry = AdapterRegistry(bank, cpu_loras)
    core = EngineCore(runner, EngineConfig(block_size=block_size, num_blocks=num_blocks,
                                           max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                           max_model_len=128, enable_prefix_caching=prefix_caching,
                                           speculative=speculative),
                      leases=AdapterLeases(registry))
    return core, registry


def register(registry: AdapterRegistry, name: str, folder: Path):
    bank = registry.bank
    return registry.register(name, load_peft(folder, layers=bank.shapes, max_rank=bank.max_rank,
                                             dtype=bank.dtype, fused=bank.fused))


def store_for(base_folder: Path, path: str, **engine) -> tuple[EngineCore, AdapterRegistry, list[bool]]:
    """lora_engine with the CPU form `path` pinned: "pool" (lora/pool.py), or the bank's "dense" (masked GEMMs)
    or "segments" (lora_apply's per-segment GEMMs); and the list that records, per forward with adapter rows,
    whether the bank really took its dense form (stays empty for the pool)."""
    core, registry = lora_engine(base_folder, pool_bytes=2**24 if path == "pool" else None, **engine)
    seen: list[bool] = []
    if path != "pool":
        bank = registry.bank
        bank.dense_max_work = 10**9 if path == "dense" else 0
        real_activate = bank.activate

        @contextmanager
        def spy(spans, num_rows):
            with real_activate(spans, num_rows) as meta:
                seen.append(bank.step.dense_mask is not None)
                yield meta
        bank.activate = spy
    return core, registry, seen
