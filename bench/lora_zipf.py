"""bench/lora.py --part zipf: a thousand adapters on disk, Zipf traffic from 64 concurrent clients.

The decoder service runs as a user starts it (`python -m services.decoder`, SmolLM2-135M-Instruct fp32, or
with --real-layers the Llama-3.2-1B-shaped checkpoint of bench/real_checkpoint.py; `--threads` threads), with
`--lora-root` holding `--registered` random rank-`--rank` PEFT adapters on q/k/v/o (written with safetensors
in peft's layout) and nothing registered at start: each adapter is loaded by
name on its first request. `--clients` closed-loop gRPC clients each send Generate calls one after another
(greedy, `--max-tokens` new tokens, eos ignored), the adapter of each drawn from a Zipf law (exponent
`--zipf`) over the registered names. The same service, the same prompts, without adapters, is the base.

Printed: end-to-end tokens/s both ways and their ratio (goal >= 0.8), how many distinct adapters the run
touched, the first-token latency of requests whose adapter was cold (loaded on demand) against that of hot
ones, and the service's own load-time figures. The vLLM peer (.venv-peers, `make bench-peers`) runs the
same request list with enable_lora, max_cpu_loras = the adapters our budget holds and max_loras = the
per-batch count, each row a LoRARequest with the adapter's path (vLLM too loads them from disk on first use).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from safetensors.torch import save_file

from bench.load import free_port
from bench.workload import ROOT, SMOLLM2
from services.common.pb import decoder_pb2, decoder_pb2_grpc

ZIPF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_adapters(root: Path, count: int, rank: int, seed: int = 0, model: Path = SMOLLM2) -> int:
    """`count` random PEFT LoRA folders root/z0000... for the checkpoint `model` (peft 0.21's key names and
    config); bytes of one."""
    cfg = json.loads((model / "config.json").read_text())
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden)}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "target_modules": list(ZIPF_TARGETS), "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": str(model)}
    gen = torch.Generator().manual_seed(seed)
    nbytes = 0
    for i in range(count):
        folder = root / f"z{i:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for target, (k, n) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.self_attn.{target}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=gen) / k ** 0.5
                tensors[f"{key}.lora_B.weight"] = 0.02 * torch.randn(n, rank, generator=gen)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(config))
        nbytes = sum(t.numel() * 4 for t in tensors.values())
    return nbytes


def zipf_names(count: int, requests: int, exponent: float, seed: int = 0) -> list[str]:
    """`requests` adapter names drawn with P(rank k) proportional to 1 / k**exponent over `count` names."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** exponent for k in range(count)]
    return [f"z{i:04d}" for i in rng.choices(range(count), weights=weights, k=requests)]


@dataclass
class Run:
    seconds: float = 0.0
    tokens: int = 0
    cold_ttft: list[float] = field(default_factory=list)
    hot_ttft: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


async def drive(port: int, prompts: list[list[int]], adapters: list[str | None], clients: int,
                max_tokens: int) -> Run:
    """Closed loop: `clients` callers share the request list in order; one Generate stream each at a time."""
    run, queue, seen = Run(), list(zip(prompts, adapters, strict=True)), set()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)

        async def caller() -> None:
            while queue:
                prompt, adapter = queue.pop(0)
                cold = adapter is not None and adapter not in seen
                seen.add(adapter)
                req = decoder_pb2.GenerateRequest(
                    adapter=adapter or "", token_ids=decoder_pb2.TokenIds(ids=prompt),
                    sampling=decoder_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
                t0, first = time.perf_counter(), None
                try:
                    async for reply in stub.Generate(req, timeout=900):
                        if first is None and reply.token_ids:
                            first = time.perf_counter() - t0
                        run.tokens += len(reply.token_ids)
                except grpc.RpcError as exc:
                    run.errors.append(f"{exc.code().name}: {exc.details()}")
                    continue
                if first is not None:
                    (run.cold_ttft if cold else run.hot_ttft).append(first)
        start = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(clients)))
        run.seconds = time.perf_counter() - start
    return run


def start_decoder(port: int, root: Path, threads: int, rank: int, registered: int, memory_gb: float,
                  log: Path, model: Path = SMOLLM2) -> subprocess.Popen:
    argv = [sys.executable, "-m", "services.decoder", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--threads", str(threads), "--insecure-no-auth", "--lora-root", str(root),
            "--lora-on-demand", "--max-cpu-loras", str(registered), "--max-lora-rank", str(rank),
            "--lora-memory-gb", str(memory_gb),
            "--max-num-seqs", "64", "--no-enable-prefix-caching"]
    for target in ZIPF_TARGETS:
        argv += ["--lora-targets", target]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the decoder exited with {proc.returncode}; see {log}")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                decoder_pb2_grpc.DecoderServiceStub(ch).GetModelInfo(decoder_pb2.GetModelInfoRequest(), timeout=2)
            return proc
        except grpc.RpcError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the decoder did not answer in 300 s; see {log}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def zipf_part(args, prompts_of, run_vllm_peer) -> list[str]:
    """Print the part's lines; return its ratios."""
    import tempfile

    names = zipf_names(args.registered, args.requests, args.zipf)
    prompts = prompts_of(args.requests)
    with tempfile.TemporaryDirectory(prefix="tessera-bench-zipf-") as tmp:
        root = Path(tmp) / "adapters"
        t0 = time.perf_counter()
        one = write_adapters(root, args.registered, args.rank, model=args.model)
        print(f"(z) {args.shape}: {args.registered} rank-{args.rank} adapters on {','.join(ZIPF_TARGETS)} "
              f"written under --lora-root in {time.perf_counter() - t0:.0f} s ({one / 2**20:.1f} MiB each); "
              f"{args.requests} requests, Zipf {args.zipf} over them ({len(set(names))} distinct), {args.clients} "
              f"clients, {args.max_tokens} new tokens each; --lora-memory-gb {args.lora_memory_gb}")
        port = free_port()
        proc = start_decoder(port, root, args.threads, args.rank, args.registered, args.lora_memory_gb,
                             Path(tmp) / "decoder.log", model=args.model)
        try:
            warm = prompts[:8]
            asyncio.run(drive(port, warm, [None] * len(warm), 8, 4))              # warm
            base = asyncio.run(drive(port, prompts, [None] * len(prompts), args.clients, args.max_tokens))
            mine = asyncio.run(drive(port, prompts, names, args.clients, args.max_tokens))
            again = asyncio.run(drive(port, prompts, [None] * len(prompts), args.clients, args.max_tokens))
        finally:
            proc.terminate()
            proc.wait(60)
        loads = [line for line in (Path(tmp) / "decoder.log").read_text().splitlines() if "on demand in" in line]
        load_ms = [float(line.split(" on demand in ", 1)[1].split()[0]) for line in loads]
        base_tok_s = max(base.tok_s, again.tok_s)
        if mine.errors or base.errors:
            print(f"    errors: {len(mine.errors)} with adapters, {len(base.errors)} base; e.g. "
                  f"{(mine.errors + base.errors)[0]}")
        print(f"(z) tessera: {mine.tok_s:.1f} tok/s with Zipf adapters, {base_tok_s:.1f} tok/s base "
              f"(best of {base.tok_s:.1f}, {again.tok_s:.1f}); ratio {mine.tok_s / base_tok_s:.2f} (goal >= 0.8)")
        print(f"    first token: cold adapter p50 {percentile(mine.cold_ttft, 0.5) * 1e3:.0f} ms / max "
              f"{max(mine.cold_ttft, default=float('nan')) * 1e3:.0f} ms ({len(mine.cold_ttft)} cold), hot p50 "
              f"{percentile(mine.hot_ttft, 0.5) * 1e3:.0f} ms / p99 {percentile(mine.hot_ttft, 0.99) * 1e3:.0f} ms, "
              f"base p50 {percentile(base.hot_ttft, 0.5) * 1e3:.0f} ms; service load time p50 "
              f"{percentile(load_ms, 0.5):.0f} ms / max {max(load_ms, default=float('nan')):.0f} ms "
              f"({len(load_ms)} loads)")
        ratios = [f"zipf_of_base={mine.tok_s / base_tok_s:.2f}"]
        if args.no_peer:
            print("(z) vLLM skipped (--no-peer)")
        else:
            budget = max(1, int(args.lora_memory_gb * 2**30 // one))
            job = {"prompts": prompts, "adapters": names,
                   "folders": {n: str(root / n) for n in sorted(set(names))},
                   "max_loras": min(budget, args.clients), "max_cpu_loras": budget, "max_lora_rank": args.rank}
            peer = run_vllm_peer("vllm_lora.py", ["--max-tokens", str(args.max_tokens)], job, args.threads,
                                 model=args.model)
            print(f"(z) vLLM enable_lora (max_loras {job['max_loras']}, max_cpu_loras {budget}): "
                  f"{peer['lora']['tok_s']:.1f} tok/s with the Zipf adapters, {peer['base']['tok_s']:.1f} without "
                  f"(its ratio {peer['lora']['tok_s'] / peer['base']['tok_s']:.2f})")
            ratios.append(f"zipf_vs_vllm={mine.tok_s / peer['lora']['tok_s']:.2f}x")
    return ratios
