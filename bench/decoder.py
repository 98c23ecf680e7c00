"""Decoder benchmark: tessera's engine vs transformers (and vLLM with --peer vllm), side by side.

Workload: SmolLM2-135M-Instruct, 64 GSM8K chat prompts, 128 new tokens
each, greedy, every sequence runs to max_tokens (eos ignored) so both sides emit
the same token count; outputs are compared token for token.

  (a) throughput, all prompts submitted at once, vs transformers static batches of 16
      (--rounds R: tessera and vLLM (e) alternate R times, each round on a cold prefix cache; the best
      round of each counts, so that a slow spell of a shared machine penalises neither side more)
  (b) batch-1 decode tokens/s vs transformers (tessera: best of 3 runs of 128 tokens, as llama.cpp's),
      and the batch-1 memory bound: a decode step reads every projection and LM-head weight once, so
      tok/s <= the machine's read bandwidth (measured in the same run) / those bytes; each engine's
      batch-1 rate is given as a fraction of it (llama.cpp's GGUF holds the same weights in the same
      dtype, Q8_0 a few percent more: its per-block scales)
  (c) prefix cache: TTFT with a shared 1,000-token prefix vs a cold request (medians of 3 pairs); and a
      burst: 16 chats sharing a 512-token system prompt submitted at once on a cold cache, the time until
      every one has its first token (median of 3), with --peer vllm against vLLM's on the same burst
  (d) headroom: tokens/s at the largest batch / the fp32 matmul bound
  (e) --peer vllm: the same workload on vLLM in .venv-peers (make bench-peers)
  (f) --peer llamacpp: llama.cpp's llama-server (build/peers/, make bench-peers) on F32 GGUF for
      fp32, BF16 GGUF for bf16 and Q8_0 GGUF for int8 (tessera's --quantization int8),
      `-t <threads> -np <prompts>`: the same prompt token ids all at once (wall clock), in each KV
      layout (unified and --no-kv-unified, the faster one counts), and batch-1 decode by the
      server's own timings (predicted_per_second, best of 3 per layout); with --rounds R > 1, R more
      batch-1 runs of each engine alternate (llama.cpp on a one-slot server), and each side's best counts.
      --peer is repeatable: --peer vllm --peer llamacpp.
  (g) mixture of experts (--parts g): Qwen3-30B-A3B's shape with --moe-layers layers, random bf16 weights
      (bench/moe_checkpoint.py, written once under build/bench/), batch-1 decode tok/s of tessera against the
      weights a step reads (8 of 128 experts per layer, attention, router, head) and, where `make
      bench-peers` has built llama.cpp, against llama-server on the same weights as BF16 GGUF (converted once).

The last line printed holds the ratios.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import moe_checkpoint  # noqa: E402
from bench.accounting import gemm_flops  # noqa: E402
from bench.peers import llamacpp  # noqa: E402
from bench.workload import SMOLLM2, gsm8k_messages, run_vllm_peer  # noqa: E402
from services.common.allocator import keep_freed_memory  # noqa: E402
from services.common.dtypes import MATMUL_PRECISIONS  # noqa: E402
from services.common.plan import DECODER as DECODER_PATHS  # noqa: E402
from services.common.plan import Pins  # noqa: E402
from services.decoder.engine.config import EngineConfig  # noqa: E402
from services.decoder.engine.engine_core import EngineCore  # noqa: E402
from services.decoder.engine.step import SamplingParams  # noqa: E402
from services.decoder.runner.runner import Runner  # noqa: E402
from services.decoder.text.chat_template import ChatTemplate  # noqa: E402
from services.decoder.text.tokenizer import Tokenizer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Variants beyond a dtype: (runner dtype, --quantization). "int8" is fp32 activations with
# weight-only int8 (model/quantization.py), set against llama.cpp's Q8_0 GGUF; transformers
# and vLLM have no such CPU mode here, so it only meets llama.cpp.
# "int4" (grouped 4-bit weights, where this tree has --quantization int4) likewise, against Q4_0 / Q4_K_M
# (bench/real_size.py).
VARIANTS = {"fp32": ("fp32", "none"), "bf16": ("bf16", "none"), "int8": ("fp32", "int8"), "int4": ("fp32", "int4")}


def prompts(count: int) -> list[list[int]]:
    tok = Tokenizer.from_folder(SMOLLM2)
    template = ChatTemplate.from_folder(SMOLLM2, tok)
    return [template.encode(tok, m, add_generation_prompt=True) for m in gsm8k_messages(count)]


class Tessera:
    """The in-process engine (core + runner), as the decoder service runs it."""

    def __init__(self, variant: str, num_blocks: int = 4096, budget: int = 2048, max_seqs: int = 64,
                 fast_paths: str = "", folder: Path = SMOLLM2, matmul_precision: str = "highest"):
        dtype, quantization = VARIANTS[variant]
        self.runner = Runner.from_folder(folder, dtype, 16, num_blocks, quantization=quantization,
                                         fast_paths=fast_paths, matmul_precision=matmul_precision)
        self.cfg = EngineConfig(block_size=16, num_blocks=num_blocks, max_num_batched_tokens=budget,
                                max_num_seqs=max_seqs, max_model_len=4096)
        self.cold()
        # As the service does once its models are loaded (services/common/server.py, ready): what is loaded is
        # frozen, so the collector's full passes during steps walk only what the steps allocated.
        gc.collect()
        gc.freeze()

    def cold(self) -> None:
        """A new engine core over the same runner: every block free, nothing in the prefix cache."""
        self.core = EngineCore(self.runner, self.cfg)

    def generate(self, batch: list[list[int]], max_tokens: int, tag: str = "r") -> tuple[list[list[int]], float]:
        """All requests at once; (outputs, seconds)."""
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = {f"{tag}{i}": [] for i in range(len(batch))}
        start = time.perf_counter()
        for i, p in enumerate(batch):
            self.core.add_request(f"{tag}{i}", p, sp)
        while self.core.has_unfinished():
            for o in self.core.step():
                out[o.request_id].extend(o.new_token_ids)
        return [out[f"{tag}{i}"] for i in range(len(batch))], time.perf_counter() - start

    def ttft(self, prompt: list[int], tag: str) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        start = time.perf_counter()
        self.core.add_request(tag, prompt, sp)
        while self.core.has_unfinished():
            self.core.step()
        return time.perf_counter() - start


class Transformers:
    def __init__(self, dtype: str):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=DTYPES[dtype]).eval()

    @torch.inference_mode()
    def generate(self, batch: list[list[int]], max_tokens: int, batch_size: int = 16):
        """Static batches, left padded; (outputs, seconds)."""
        outs, start = [], time.perf_counter()
        for s in range(0, len(batch), batch_size):
            group = batch[s:s + batch_size]
            width = max(map(len, group))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            gen = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            outs.extend(gen[:, width:].tolist())
        return outs, time.perf_counter() - start


def burst_line(ours: Tessera, batch: list[list[int]], text: list[int], threads: int, vllm: bool) -> list[str]:
    """(c)'s burst: 16 of the chats behind one 512-token system prompt (the text's first 512 tokens), all
    submitted at once after a warm-up prompt that shares no block with them, the last chat reversed (vLLM's
    peer script warms up on the first prompt it is given, so both sides get [warm-up, *burst]); the seconds
    until every request has its first token, tessera's median of 3 on a cold prefix cache each, and vLLM's.
    Returns the ratios for the last line: vLLM's time over ours, or none without vLLM."""
    warm, burst = batch[-1][::-1], [text[:512] + p for p in batch[:16]]
    times = []
    for i in range(3):
        ours.cold()
        ours.generate([warm], 4, tag=f"c-burst-warm{i}")
        times.append(ours.generate([warm, *burst], 1, tag=f"c-burst{i}-")[1])
    mine = statistics.median(times)
    line = (f"(c) burst of 16 chats sharing a 512-token system prompt, every first token: tessera "
            f"{mine * 1e3:.0f} ms (median of {', '.join(f'{t * 1e3:.0f}' for t in times)} ms)")
    if not vllm:
        print(line)
        return []
    theirs = run_vllm_peer("vllm_decoder.py", ["--dtype", "fp32", "--max-tokens", "1"], [warm, *burst], threads)
    print(f"{line}, vLLM {theirs['seconds'] * 1e3:.0f} ms")
    return [f"burst_ttft_vs_vllm={theirs['seconds'] / mine:.2f}x"]


def batch1_rate(engine: Tessera, prompt: list[int], max_tokens: int, tag: str) -> float:
    """Decode tok/s of one request alone: a run of max_tokens minus a run of 1, both over the cached
    prompt, so the difference is the max_tokens - 1 decode steps only."""
    _, t1 = engine.generate([prompt], 1, tag=f"b1-{tag}")
    _, tn = engine.generate([prompt], max_tokens, tag=f"bn-{tag}")
    return (max_tokens - 1) / (tn - t1)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def read_bandwidth() -> float:
    """Measured bytes/s at which this process's torch threads read memory: torch.sum over 256 MiB (best of 5)."""
    x = torch.ones(64 * 2 ** 20)
    x.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * x.element_size() / best


def linear_bytes(m: torch.nn.Linear) -> tuple[int, int]:
    """(bytes of the weight a step of m reads, weights in it): a grouped form (any dataclass of tensors m holds:
    codes, scales, offsets) or int8's with its scales where m has one, else the dense weight."""
    weights = m.in_features * m.out_features
    for name, v in vars(m).items():
        if name != "lora" and dataclasses.is_dataclass(v) and not isinstance(v, type):
            parts = [getattr(v, f.name) for f in dataclasses.fields(v)]
            tensors = [t for t in parts if isinstance(t, torch.Tensor)]
            if tensors:
                return sum(t.numel() * t.element_size() for t in tensors), weights
    w = getattr(m, "qweight", None)
    if w is not None:
        return w.numel() * w.element_size() + m.qscale.numel() * m.qscale.element_size(), weights
    return m.weight.numel() * m.weight.element_size(), m.weight.numel()


def decode_bytes(runner: Runner) -> int:
    """Bytes of weights one decode step reads: every Linear's weight in the form its step reads (int8 or
    grouped ones with their scales), the LM head included; the embedding lookup reads one row and the KV
    cache a few MB, left out."""
    return sum(linear_bytes(m)[0] for m in runner.model.modules() if isinstance(m, torch.nn.Linear))


def screened_bytes(runner: Runner) -> int | None:
    """Bytes a greedy batch-1 step of this runner reads when the argmax screen runs (model/screen.py): the
    head's bf16 copy in place of the fp32 head; None without the screen."""
    if runner.screen is None:
        return None
    head, low = runner.model.lm_head.weight, runner.screen.low
    return decode_bytes(runner) - head.numel() * head.element_size() + low.numel() * low.element_size()


MOE_DIR = Path(__file__).resolve().parents[1] / "build" / "bench"


def moe_line(folder: Path, prompt: list[int], max_tokens: int, threads: int, fast_paths) -> list[str]:
    """(g): batch-1 decode of the MoE checkpoint in folder (bf16), tessera then llama.cpp; the ratios."""
    cfg = json.loads((folder / "config.json").read_text())
    ours = Tessera("bf16", num_blocks=64, budget=512, max_seqs=1, fast_paths=fast_paths, folder=folder)
    ours.generate([prompt], 1, tag="g-warm")
    runs = [batch1_rate(ours, prompt, max_tokens, f"g{rep}") for rep in range(3)]
    del ours
    parts = moe_checkpoint.decode_bytes(cfg, 2)
    bandwidth = read_bandwidth()
    bound = bandwidth / sum(parts.values())
    read = ", ".join(f"{k} {v / 1e6:.0f}" for k, v in parts.items())
    print(f"(g) bf16 {folder.name} ({cfg['num_hidden_layers']} layers, {cfg['num_experts_per_tok']} of "
          f"{cfg['num_experts']} experts): batch-1 decode tessera {', '.join(f'{r:.1f}' for r in runs)} tok/s; a "
          f"step reads {sum(parts.values()) / 1e6:.0f} MB ({read}) -> bound {bound:.1f} tok/s at "
          f"{bandwidth / 1e9:.1f} GB/s; tessera at {max(runs) / bound:.2f} of it")
    gguf, why = llamacpp.gguf_of(folder, "bf16")
    if gguf is None:
        print(f"(g) llama.cpp not run: {why}")
        return []
    with llamacpp.LlamaServer(gguf, threads, 1, llamacpp.slot_ctx([prompt], max_tokens)) as srv:
        srv.complete(prompt, 4)                            # warm-up
        theirs = srv.batch1(prompt, max_tokens)
    print(f"(g) bf16 {gguf.name} batch-1 decode: llama.cpp {', '.join(f'{r:.1f}' for r in theirs)} tok/s "
          f"({max(theirs) / bound:.2f} of the bound); tessera best {max(runs):.1f}")
    return [f"vs_llamacpp_moe_b1_bf16={max(runs) / max(theirs):.2f}x"]


def run_vllm(dtype: str, batch: list[list[int]], max_tokens: int, threads: int) -> dict:
    return run_vllm_peer("vllm_decoder.py", ["--dtype", dtype, "--max-tokens", str(max_tokens)], batch, threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32,bf16,int8 (int8: --quantization "
                                                           "int8 over fp32, against llama.cpp's Q8_0 only)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for every engine")
    ap.add_argument("--fast-paths", default="", help="the decoder's --fast-paths: pin paths instead of timing "
                    "them at load, e.g. screen=off or huge_pages=off,malloc=default (A/B runs)")
    ap.add_argument("--matmul-precision", default="highest", choices=MATMUL_PRECISIONS,
                    help="tessera's --matmul-precision (high: fp32 products split in bf16 halves on the tile unit "
                         "where the CPU has AMX; the peers keep theirs)")
    ap.add_argument("--parts", default="a,b,c,d", help="which parts to run (a,b,c,d; g: the MoE line)")
    ap.add_argument("--moe-layers", type=int, default=2, help="(g): layers of the Qwen3-30B-A3B-shaped checkpoint "
                    "(each about 1.2 GB in bf16)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="(a)/(e): run tessera and vLLM alternately this many times, each on a cold prefix "
                         "cache; (f): add this many alternating batch-1 runs of tessera and a one-slot "
                         "llama-server (when > 1); the best of each side counts")
    ap.add_argument("--peer", choices=("vllm", "llamacpp"), action="append", default=[],
                    help="also run the workload on vLLM (part e) and/or llama.cpp (part f); repeatable")
    ap.add_argument("--llamacpp-kv", choices=("both", "unified", "split"), default="both",
                    help="llama-server KV layout(s): unified, --no-kv-unified (split), or both")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    torch.set_num_threads(args.threads)
    # As the decoder service does at start; the transformers baseline shares this process.
    try:
        pins = Pins.parse(args.fast_paths, DECODER_PATHS)
    except ValueError as e:
        ap.error(str(e))
    print(f"malloc: {keep_freed_memory(pins.get('malloc'))}", flush=True)
    parts = set(args.parts.split(","))
    peers = set(args.peer)
    batch = prompts(args.prompts)
    ratios = []
    llamacpp_b1, llamacpp_64 = [], []
    best_tps = {}
    if "llamacpp" in peers:
        kv_modes = llamacpp.kv_modes_supported() if args.llamacpp_kv == "both" else (args.llamacpp_kv,)
    if "g" in parts:
        folder = moe_checkpoint.write(MOE_DIR / f"qwen3-30b-a3b-shape-{args.moe_layers}L", args.moe_layers, SMOLLM2)
        llamacpp_b1 += moe_line(folder, batch[0], args.max_tokens, args.threads, pins)
    for dtype in args.dtypes.split(",") if parts & set("abcd") or peers else ():
        ours = Tessera(dtype, fast_paths=pins, matmul_precision=args.matmul_precision)
        print(f"{dtype}: quantization {ours.runner.quantization}; --matmul-precision {args.matmul_precision}; "
              f"fast paths {ours.runner.plan.summary()}; "
              f"memory {ours.runner.plan.get('huge_pages').reason}")
        print(f"{dtype}: {ours.runner.plan.get('gemv_bf16_row').line()}")   # the bf16 loop and its load-time times
        reference = dtype in DTYPES        # transformers and vLLM run this variant too
        if "a" in parts or peers:
            vllm_here = "vllm" in peers and reference
            ours_runs, vllm_runs = [], []
            for rnd in range(args.rounds):
                ours.cold()
                ours.generate(batch[:2], 4, tag="warm")
                mine, t_ours = ours.generate(batch, args.max_tokens)
                ours_runs.append(len(batch) * args.max_tokens / t_ours)
                print(f"(a) {dtype} tessera round {rnd + 1}: {ours_runs[-1]:.1f} tok/s ({t_ours:.1f}s)")
                if vllm_here:
                    peer = run_vllm(dtype, batch, args.max_tokens, args.threads)
                    vllm_runs.append(peer["tok_s"])
                    print(f"(e) {dtype} vLLM round {rnd + 1}: {peer['tok_s']:.1f} tok/s; identical outputs "
                          f"{agreement(mine, peer['outputs']):.0%}")
            tps = max(ours_runs)
            best_tps[dtype] = tps
            print(f"(a) {dtype} tessera: {tps:.1f} tok/s (best of {args.rounds})")
            if "a" in parts and reference:
                ref = Transformers(dtype)
                theirs, t_ref = ref.generate(batch, args.max_tokens)
                ref_tps = len(batch) * args.max_tokens / t_ref
                print(f"(a) {dtype} transformers static batches of 16: {ref_tps:.1f} tok/s ({t_ref:.1f}s); "
                      f"identical outputs {agreement(mine, theirs):.0%}")
                ratios.append(f"throughput_{dtype}={tps / ref_tps:.2f}x")
            if vllm_here:
                print(f"(e) {dtype} vLLM: {max(vllm_runs):.1f} tok/s (best of {args.rounds})")
                ratios.append(f"vs_vllm_{dtype}={tps / max(vllm_runs):.2f}x")
        lc = None
        if "llamacpp" in peers:
            lc = llamacpp.run(dtype, batch, args.max_tokens, args.threads, kv_modes)
            for mode, m in lc["modes"].items():
                load = "/".join(f"{x:.1f}" for x in m["load"])
                print(f"(f) {dtype} llama.cpp {llamacpp.GGUF[dtype].name} -t {args.threads} -np {len(batch)} "
                      f"-c {lc['ctx']} ({lc['per_slot']}/slot), {mode} KV: {m['tok_s']:.1f} tok/s "
                      f"({m['tokens']} tokens in {m['seconds']:.1f}s); identical outputs "
                      f"{agreement(mine, m['outputs']):.0%}; batch-1 "
                      f"{', '.join(f'{x:.1f}' for x in m['b1'])} tok/s; load avg {load}"
                      f"{'' if m['repack'] else '; --no-repack (it crashed loading with repacking)'}")
            llamacpp_64.append(f"vs_llamacpp_{dtype}={tps / lc['modes'][lc['best']]['tok_s']:.2f}x")
        if "b" in parts:
            one = batch[:1]
            # Best of 3, as llama.cpp's batch-1 figure; the prompt is cached first.
            ours.generate(one, 1, tag="b1-warm")
            runs = [batch1_rate(ours, one[0], args.max_tokens, str(rep)) for rep in range(3)]
            their_b1 = lc["b1"] if lc is not None else None
            print(f"(b) {dtype} batch-1 runs: tessera {', '.join(f'{r:.1f}' for r in runs)} tok/s; decode stack "
                  f"{ours.runner.plan.chosen('decode_stack')}")
            if lc is not None and args.rounds > 1:
                theirs, mine = llamacpp.batch1_rounds(dtype, one[0], args.max_tokens, args.threads, args.rounds,
                                                      functools.partial(batch1_rate, ours, one[0], args.max_tokens))
                print(f"(f) {dtype} batch-1 alternating on a one-slot llama-server: llama.cpp "
                      f"{', '.join(f'{r:.1f}' for r in theirs)}, tessera {', '.join(f'{r:.1f}' for r in mine)} tok/s")
                runs += mine
                their_b1 = max(their_b1, *theirs)
            ours_b1 = max(runs)
            bandwidth, weights = read_bandwidth(), decode_bytes(ours.runner)
            b1_bound = bandwidth / weights
            print(f"(b) {dtype} batch-1 memory bound: read {bandwidth / 1e9:.1f} GB/s / {weights / 1e6:.0f} MB a "
                  f"step -> {b1_bound:.1f} tok/s; tessera at {ours_b1 / b1_bound:.2f} of it")
            screened = screened_bytes(ours.runner)
            if screened is not None:
                print(f"(b) {dtype} tessera's greedy steps read {screened / 1e6:.0f} MB with the argmax screen "
                      f"(bf16 head copy): its own bound {bandwidth / screened:.1f} tok/s")
            if reference:
                ref = Transformers(dtype)
                _, r1 = ref.generate(one, 1)
                _, rn = ref.generate(one, args.max_tokens)
                ref_b1 = (args.max_tokens - 1) / (rn - r1)
                print(f"(b) {dtype} batch-1 decode: tessera {ours_b1:.1f} tok/s, transformers {ref_b1:.1f} tok/s")
                ratios.append(f"batch1_{dtype}={ours_b1 / ref_b1:.2f}x")
            else:
                print(f"(b) {dtype} batch-1 decode: tessera {ours_b1:.1f} tok/s")
            if lc is not None:
                print(f"(f) {dtype} batch-1 decode: tessera {ours_b1:.1f} tok/s, llama.cpp {their_b1:.1f} tok/s "
                      f"(best of its runs; {their_b1 / b1_bound:.2f} of the memory bound)")
                llamacpp_b1.append(f"vs_llamacpp_b1_{dtype}={ours_b1 / their_b1:.2f}x")
        if "c" in parts and dtype == "fp32":
            # Median of 3 alternating pairs, each with its own uncached 1,000-token prefix and its own
            # 20-token suffix: one pair alone moved the ratio by 1.5x between runs on a shared VM.
            text = [t for p in batch for t in p]
            if len(text) < 4000 or len(batch) < 17:
                sys.exit(f"(c) needs 4,000 prompt tokens and 17 prompts; --prompts {len(batch)} gives {len(text)}")
            cached = text[:1000]
            ours.ttft(cached + batch[0][-20:], "c-warmup")         # caches `cached`
            colds, warms = [], []
            for i in range(3):
                colds.append(ours.ttft(text[1000 * (i + 1):1000 * (i + 2)] + batch[1 + i][-20:], f"c-cold{i}"))
                warms.append(ours.ttft(cached + batch[4 + i][-20:], f"c-warm{i}"))
            cold, warm = statistics.median(colds), statistics.median(warms)
            print(f"(c) TTFT with a cached 1,000-token prefix: {warm * 1e3:.1f} ms vs cold {cold * 1e3:.1f} ms "
                  f"(medians of warm {', '.join(f'{w * 1e3:.1f}' for w in warms)} and cold "
                  f"{', '.join(f'{c * 1e3:.1f}' for c in colds)} ms)")
            ratios.append(f"prefix_ttft={warm / cold:.3f}x")
            ratios += burst_line(ours, batch, text, args.threads, "vllm" in peers)
        del ours
    if "d" in parts and "fp32" in best_tps:
        flops = gemm_flops()
        params = sum(p.numel() for p in Runner.from_folder(SMOLLM2, "fp32", 16, 1).model.parameters())
        bound = flops / (2 * params)
        print(f"(d) fp32 GEMM {flops / 1e9:.1f} GFLOP/s -> bound {bound:.0f} tok/s for {params / 1e6:.0f}M params; "
              f"largest batch reached {best_tps['fp32']:.1f} tok/s")
        ratios.append(f"headroom_fp32={best_tps['fp32'] / bound:.2f}")
    print("ratios: " + " ".join(ratios + llamacpp_b1 + llamacpp_64))


if __name__ == "__main__":
    main()
