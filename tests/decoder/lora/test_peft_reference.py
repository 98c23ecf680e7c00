"""Mixed-adapter batches against peft 0.21's own mixed batches (adapter_names=[...]).

Three adapters of different ranks, alphas and target sets plus base-only rows share
one forward; logits must match peft's, and greedy tokens through the engine (staggered
arrivals, prefill chunks cut by a tiny token budget) must equal peft's generate.
"""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from services.decoder.engine.step import SamplingParams, StepInput
from services.decoder.lora import adapter_request
from tests.decoder.lora.adapters import SPECS, lora_engine, peft_mixed, register, write_adapter
from tests.decoder.model.checkpoints import TINY_SHAPE, build
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close, is_close

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 77, 21, 8], [40, 41], list(range(10, 29)), [99, 3, 150, 12, 64]]
# (prompt index, adapter or None = base): every adapter and the base model, prompts shared across them.
WORKLOAD = [(0, "alpha"), (1, None), (2, "beta"), (0, "gamma"), (3, "alpha"), (2, None), (1, "beta"),
            (3, "gamma"), (0, None), (2, "alpha")]


@pytest.fixture(scope="module", params=["llama_mha_untied", "qwen2_gqa2_odd_tied", "granite_gqa2_multipliers",
                                        "olmo2_gqa4_postnorm"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("peftref")
    base = build(root, request.param)
    folders = {s.name: write_adapter(base, root / "adapters", s) for s in SPECS}
    return base, folders, peft_mixed(base, folders)


# The matmul path pinned each way: with it timed at load (auto), a loaded machine once gave base rows of the
# mixed step that differed from the adapter-free step's in the last bits, which the pins here never do.
@pytest.mark.parametrize("linear", ["plain", "packed"])
@pytest.mark.parametrize("path", ["dense", "segments", "pool"])
def test_mixed_batch_logits_match_peft(setup, path, linear):
    """The bank's two CPU forms: the dense masked GEMMs (small steps) and lora_apply's per-segment GEMMs;
    and the CPU adapter pool's rank rows (lora/pool.py)."""
    base, folders, peft = setup
    core, registry = lora_engine(base, fast_paths=f"screen=on,linear={linear}",
                                 pool_bytes=2**24 if path == "pool" else None)
    seen = []
    if path != "pool":
        registry.bank.dense_max_work = 10**9 if path == "dense" else 0
        real_activate = registry.bank.activate

        @contextmanager
        def spy(spans, num_rows):
            with real_activate(spans, num_rows) as meta:
                seen.append(registry.bank.step.dense_mask is not None)    # which form this forward really takes
                yield meta
        registry.bank.activate = spy
    for name, folder in folders.items():
        register(registry, name, folder)
    runner = core.runner
    rows = ["alpha", "__base__", "beta", "gamma", "alpha", "__base__"]
    torch.manual_seed(7)
    prompts = torch.randint(4, 150, (len(rows), 9))
    alloc = BlockAllocator(128)
    seqs = [Seq(str(i), prompts[i].tolist(),
                lora_slot=None if n == "__base__" else registry.status(n).slot)
            for i, n in enumerate(rows)]
    got, _ = runner.logits(StepInput([s.chunk(9, alloc, 4) for s in seqs]))
    got = got.clone()
    with torch.no_grad():
        want = peft(input_ids=prompts, adapter_names=rows).logits[:, -1].float()
        base_only = peft(input_ids=prompts, adapter_names=["__base__"] * len(rows)).logits[:, -1].float()
    assert_close(got, want, **TINY_SHAPE)
    assert seen == ([] if path == "pool" else [path == "dense"])
    # The adapters matter: adapter rows differ from the base beyond rounding, base rows do not at all.
    for i, n in enumerate(rows):
        if n == "__base__":
            assert torch.equal(want[i], base_only[i])
        else:
            assert not is_close(want[i], base_only[i], **TINY_SHAPE), n
    # Invariant 6: base rows of the mixed step equal the same step with no adapter at all, bit for bit.
    plain = [Seq(str(i), prompts[i].tolist()) for i in range(len(rows))]
    # One allocator for the step: sequences sharing blocks would overwrite each other's KV, which the
    # in-place attention operator reads back even for a first chunk (runner/attention.py).
    fresh = BlockAllocator(128)
    alone, _ = runner.logits(StepInput([s.chunk(9, fresh, 4) for s in plain]))
    for i in (1, 5):
        assert torch.equal(got[i], alone[i])


def peft_greedy(peft, prompt, adapter):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                            do_sample=False, eos_token_id=None, pad_token_id=0,
                            adapter_names=[adapter or "__base__"])
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("store", ["bank", "pool"])
def test_engine_greedy_equals_peft_generate(setup, store):
    base, folders, peft = setup
    expected = [peft_greedy(peft, PROMPTS[p], a) for p, a in WORKLOAD]
    core, registry = lora_engine(base, budget=5, pool_bytes=2**24 if store == "pool" else None)
    digests = {n: register(registry, n, f).digest for n, f in folders.items()}
    got = {str(i): [] for i in range(len(WORKLOAD))}
    pending, steps = list(enumerate(WORKLOAD)), 0
    while pending or core.has_unfinished():
        if pending and steps % 2 == 0:   # staggered: one arrival every other step
            i, (p, a) = pending.pop(0)
            adapter, keys = adapter_request(a, digests[a]) if a else (None, ())
            core.add_request(str(i), PROMPTS[p], GREEDY, extra_keys=keys, adapter=adapter)
        for out in core.step():
            assert out.finish_reason in (None, "length"), out
            got[out.request_id].extend(out.new_token_ids)
        steps += 1
        assert steps < 3000
    assert [got[str(i)] for i in range(len(WORKLOAD))] == expected
    # Adapters change the greedy tokens (otherwise this test could not fail on a lost adapter).
    assert expected[0] != expected[8] and expected[5] != expected[9]
    core.check_idle()
    assert registry.total_refs == 0
