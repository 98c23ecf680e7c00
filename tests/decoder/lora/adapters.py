"""Real PEFT adapters for tests: peft 0.21 writes them, with random non-zero lora_B.

peft initialises lora_B to zero (the adapter starts as the identity); the tests
overwrite A and B with random values before saving so every adapter changes the
logits and a wrong slot, scale or target would show.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

from services.decoder.engine.config import EngineConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.step import SamplingParams, StepInput
from services.decoder.lora import AdapterBank, AdapterLeases, AdapterPool, AdapterRegistry, adapter_request, load_peft
from services.decoder.runner.runner import Runner
from tests.decoder.model.checkpoints import TINY_SHAPE, load_reference
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close, is_close


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


def derived_adapter(template: Path, out: Path, rank: int, alpha: float, seed: int) -> Path:
    """A PEFT adapter on `template`'s targets with its own rank, alpha and random weights (peft's layout and
    config, as write_adapter's scale): written without building a peft model per adapter."""
    tensors = load_file(template / "adapter_model.safetensors")
    assert all(".lora_A." in k or ".lora_B." in k for k in tensors), sorted(tensors)
    gen = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True)
    save_file({k: 0.3 * torch.randn((rank, t.shape[1]) if ".lora_A." in k else (t.shape[0], rank), generator=gen)
               for k, t in tensors.items()}, out / "adapter_model.safetensors")
    config = json.loads((template / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "r": rank, "lora_alpha": alpha}))
    return out


def peft_mixed(base_folder: Path, folders: dict[str, Path]) -> PeftModel:
    """One PeftModel holding every adapter (for adapter_names=[...] mixed batches)."""
    names = list(folders)
    model = PeftModel.from_pretrained(load_reference(base_folder), folders[names[0]], adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(folders[n], adapter_name=n)
    return model.eval()


# lora_engine's default pins (its docstring says why); a test that pins more adds to them.
PINS = "screen=on,speculation=always"


def lora_engine(base_folder: Path, *, slots: int = 4, max_rank: int = 8, cpu_loras: int = 8,
                targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                block_size: int = 4, num_blocks: int = 128, budget: int = 64, max_seqs: int = 8,
                prefix_caching: bool = True, speculative=None, device: str = "cpu",
                fast_paths: str = PINS, pool_bytes: int | None = None, dtype: str = "fp32"
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


def assert_distinct_batch_equals_peft(core: EngineCore, registry: AdapterRegistry, folders: dict[str, Path],
                                      peft: PeftModel, new_tokens: int, block_size: int = 4) -> None:
    """Every row on its own adapter of `folders` (registered here, all placed at once): one forward of those
    rows and two base rows equals peft's mixed batch (adapter_names) within the shared tolerance, the
    adapters visibly changing the logits; then through the engine, all admitted at once (no eviction),
    `new_tokens` greedy tokens per row as peft's generate. Prompts: 6 random ids below 150 per row."""
    digests = {n: register(registry, n, f).digest for n, f in folders.items()}
    names, rows = list(folders), len(folders)
    assert registry.slots_in_use == rows
    prompts = torch.randint(4, 150, (rows, 6), generator=torch.Generator().manual_seed(11))

    alloc = BlockAllocator(1024)
    seqs = [Seq(str(i), prompts[i].tolist(), lora_slot=registry.status(n).slot) for i, n in enumerate(names)]
    seqs += [Seq("b0", prompts[0].tolist()), Seq("b1", prompts[1].tolist())]
    got, _ = core.runner.logits(StepInput([s.chunk(6, alloc, block_size) for s in seqs]))
    with torch.no_grad():
        want = peft(input_ids=torch.cat([prompts, prompts[:2]]),
                    adapter_names=names + ["__base__", "__base__"]).logits[:, -1].float()
    assert_close(got, want, **TINY_SHAPE)
    assert all(not is_close(want[i], want[rows + i], **TINY_SHAPE) for i in (0, 1)), "the adapters change nothing"

    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, n in enumerate(names):
        adapter, keys = adapter_request(n, digests[n])
        core.add_request(str(i), prompts[i].tolist(), greedy, extra_keys=keys, adapter=adapter)
    tokens, most = {str(i): [] for i in range(rows)}, 0
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
        most = max(most, registry.slots_leased)
    assert most == rows and registry.num_evictions == 0
    with torch.no_grad():
        out = peft.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                            do_sample=False, eos_token_id=None, pad_token_id=0, adapter_names=names)
    assert [tokens[str(i)] for i in range(rows)] == out[:, 6:].tolist()
    core.check_idle()
    assert registry.total_refs == 0


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
