"""The decoder's runner and engine on one CUDA GPU against transformers and peft there (a script, not a test).

    python3 -m tests.decoder.lora.cuda_check          # on a CUDA machine (~1 min)
    python3 -m tests.decoder.lora.cuda_check --cpu    # the same checks on the CPU, to try the script here

On CUDA the model runs torch's paths (no C++ operators) and LoRA goes through the compiled Triton
BGMV/SGMV kernels, which `make test` only runs under the interpreter. For the two tiny checkpoints of
tests/decoder/lora/test_peft_reference.py, fp32, TF32 off:
1. the base model's last-position logits for a 6-row prefill match transformers' on the same device;
2. a mixed batch (three adapters of different ranks and targets plus base rows) matches peft's mixed
   batch (adapter_names=[...]), and its base rows equal a step with no adapter bit for bit;
3. greedy tokens through the engine (staggered arrivals, prefill chunks cut by a 5-token budget)
   equal peft's generate for every request, and every KV block and adapter lease is idle afterwards.
Tolerances come from tests/tolerance.py. Exits 1 on the first mismatch.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--cpu", action="store_true", help="run on the CPU (the Triton kernels need TRITON_INTERPRET=1)")
    device = "cpu" if args.parse_args(argv).cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device; use --cpu")
    # Reference matmuls in true fp32 on both sides, so one fp32 tolerance holds.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from services.decoder.engine.step import StepInput
    from services.decoder.kernels.lora import backend_name
    from services.decoder.lora import adapter_request
    from tests.decoder.lora.adapters import SPECS, lora_engine, peft_mixed, register, write_adapter
    from tests.decoder.lora.test_peft_reference import GREEDY, PROMPTS, WORKLOAD
    from tests.decoder.model.checkpoints import TINY_SHAPE, build, load_reference
    from tests.decoder.runner.driver import BlockAllocator, Seq
    from tests.tolerance import assert_close, is_close

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, LoRA backend {backend_name(device)}")
    root = Path(tempfile.mkdtemp(prefix="cudacheck"))
    for case in ("llama_mha_untied", "qwen2_gqa2_odd_tied"):
        t0 = time.perf_counter()
        base = build(root, case)
        folders = {s.name: write_adapter(base, root / case / "adapters", s) for s in SPECS}
        peft = peft_mixed(base, folders).to(device)
        reference = load_reference(base).to(device)
        core, registry = lora_engine(base, device=device)
        for n, f in folders.items():
            register(registry, n, f)
        runner = core.runner
        assert runner.device.type == device, runner.device
        rows = ["alpha", "__base__", "beta", "gamma", "alpha", "__base__"]
        gen = torch.Generator().manual_seed(7)
        prompts = torch.randint(4, 150, (len(rows), 9), generator=gen)

        def logits(names, runner=runner, registry=registry, prompts=prompts):
            seqs = [Seq(str(i), prompts[i].tolist(),
                        lora_slot=None if n is None else registry.status(n).slot)
                    for i, n in enumerate(names)]
            alloc = BlockAllocator(128)
            out, _ = runner.logits(StepInput([s.chunk(9, alloc, 4) for s in seqs]))
            return out.clone()

        # 1. base model vs transformers
        ids = prompts.to(device)
        with torch.no_grad():
            want_base = reference(input_ids=ids).logits[:, -1].float()
        got_base = logits([None] * len(rows))
        assert_close(got_base, want_base, **TINY_SHAPE)
        err_base = (got_base - want_base).abs().max().item()
        # 2. mixed adapters vs peft
        got = logits([None if n == "__base__" else n for n in rows])
        with torch.no_grad():
            want = peft(input_ids=ids, adapter_names=rows).logits[:, -1].float()
        assert_close(got, want, **TINY_SHAPE)
        for i, n in enumerate(rows):
            if n == "__base__":
                assert torch.equal(got[i], got_base[i]), f"base row {i} changed by the adapters in its batch"
            else:
                assert not is_close(want[i], want_base[i], **TINY_SHAPE), f"adapter {n} does not matter"
        err_mixed = (got - want).abs().max().item()
        # 3. greedy through the engine vs peft generate
        expected = []
        for p, a in WORKLOAD:
            x = torch.tensor([PROMPTS[p]], device=device)
            with torch.no_grad():
                out = peft.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=GREEDY.max_tokens,
                                    do_sample=False, eos_token_id=None, pad_token_id=0,
                                    adapter_names=[a or "__base__"])
            expected.append(out[0, len(PROMPTS[p]):].tolist())
        core, registry = lora_engine(base, budget=5, device=device)
        digests = {n: register(registry, n, f).digest for n, f in folders.items()}
        got_tokens = {str(i): [] for i in range(len(WORKLOAD))}
        pending, steps = list(enumerate(WORKLOAD)), 0
        while pending or core.has_unfinished():
            if pending and steps % 2 == 0:
                i, (p, a) = pending.pop(0)
                adapter, keys = adapter_request(a, digests[a]) if a else (None, ())
                core.add_request(str(i), PROMPTS[p], GREEDY, extra_keys=keys, adapter=adapter)
            for out in core.step():
                got_tokens[out.request_id].extend(out.new_token_ids)
            steps += 1
            assert steps < 3000
        tokens = [got_tokens[str(i)] for i in range(len(WORKLOAD))]
        same = sum(a == b for a, b in zip(tokens, expected, strict=True))
        assert tokens == expected, f"greedy tokens differ from peft in {len(WORKLOAD) - same} of {len(WORKLOAD)}"
        assert expected[0] != expected[8], "adapter alpha does not change the greedy tokens"
        core.check_idle()
        assert registry.total_refs == 0
        print(f"{case:22s} base vs transformers max|err|={err_base:.2e}  mixed vs peft max|err|={err_mixed:.2e}  "
              f"greedy {same}/{len(WORKLOAD)} equal to peft in {steps} steps  idle ok  "
              f"({time.perf_counter() - t0:.1f} s)")
    print("decoder on", name, "matches transformers and peft: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
