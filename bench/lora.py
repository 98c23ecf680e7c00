"""LoRA benchmark: many adapters in one batch, tessera's engine vs no adapters, vs peft, vs vLLM, side by side.

Workload: SmolLM2-135M-Instruct on CPU, `--threads` threads (2), GSM8K chat prompts, random PEFT adapters
(non-zero B, saved with peft into a temporary folder), greedy, `--max-tokens` new tokens per row (eos ignored, so
every side emits the same count). The engine runs as the decoder service does on CPU: adapters in its pool.
`--real-layers N` runs every part on the real-size checkpoint of bench/real_checkpoint.py
instead (Llama-3.2-1B's shape with N of its 16 layers, random bf16 weights; adapters made for that shape; the
adapter pool's budget grows to hold all of them at once); every line then names that shape.
Decode tokens/s are timed from the step after the last row's first token (prefill out); each side runs three
times (six at 1 and 4 rows), interleaved, and keeps its best; a ratio is the median over the rounds of the two
sides' decode tokens/s in the same round (the machine is shared). `--part` picks:

  mixed (a)-(c): `--rows` rows round-robin over `--adapters` rank-16 adapters on q/k/v/o, fp32:
      (a) decode tokens/s of the mixed batch / the same batch with no adapters;
      (b) peft's mixed-adapter generate (adapter_names=[...], one left-padded batch), end-to-end tokens/s and
          how many rows have greedy outputs identical to tessera's;
      (c) vLLM in .venv-peers (make bench-peers), enable_lora, max_loras=8, a LoRARequest per row.
  distinct (d)-(f): 64 rows, every row on its own adapter, for q/v rank 8 and for all seven projections at
      ranks 8 and 16: (d) decode at 1, 4 and 64 rows against no adapters, fp32 and bf16, with the adapter bytes
      a 64-row step reads beside the model's weights, each ratio's cap were those bytes read after the base step at
      the machine's rate, the rate they took, and the share of that rate the base step's weights take;
      (e) peft; (f) vLLM with max_loras = max_cpu_loras = 64.
  zipf (z): bench/lora_zipf.py, 1,000 adapters on disk loaded on demand by the decoder service, Zipf traffic
      from 64 clients, against the same service without adapters, and vLLM with the same adapter budget.

--no-peer skips vLLM, --no-peft peft's generate (both slow on the real-size checkpoint). The line before the
last says of each goal of the issue (decode with distinct adapters >= 0.9 of base at 64 rows and >= 0.85 at 1
and 4; Zipf traffic >= 0.8) whether it was met; the last line holds the ratios, with the CPU and the model.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import real_checkpoint  # noqa: E402
from bench.decoder import agreement, prompts, read_bandwidth  # noqa: E402
from bench.lora_zipf import zipf_part  # noqa: E402
from bench.workload import SMOLLM2, cpu_line, run_vllm_peer  # noqa: E402
from services.decoder.engine.config import EngineConfig  # noqa: E402
from services.decoder.engine.engine_core import EngineCore  # noqa: E402
from services.decoder.engine.step import SamplingParams  # noqa: E402
from services.decoder.lora import AdapterLeases, AdapterRegistry, adapter_request, load_peft  # noqa: E402
from services.decoder.lora.pool import AdapterPool  # noqa: E402
from services.decoder.runner.runner import Runner  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_TARGETS = (*TARGETS, "gate_proj", "up_proj", "down_proj")
RANK = 16


def make_adapters(folder: Path, count: int, seed: int = 0, ranks: tuple[int, ...] = (RANK,),
                  targets: tuple[str, ...] = TARGETS, model: Path = SMOLLM2):
    """`count` random adapters for the checkpoint `model` in one PeftModel (for peft's mixed batches), adapter
    i of rank ranks[i % len(ranks)], each also saved with peft under folder/<name>. lora_A and lora_B are random
    (peft's B starts at zero: the identity)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    configs = [LoraConfig(r=ranks[i % len(ranks)], lora_alpha=ranks[i % len(ranks)], target_modules=list(targets),
                          lora_dropout=0.0) for i in range(count)]
    names = [f"a{i}" for i in range(count)]
    peft_model = get_peft_model(base, configs[0], adapter_name=names[0])
    for name, config in zip(names[1:], configs[1:], strict=True):
        peft_model.add_adapter(name, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if "lora_A" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in pname:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    folders = {}
    for name in names:
        peft_model.save_pretrained(folder, selected_adapters=[name])
        folders[name] = folder / name  # peft writes a non-default adapter into a subfolder of its name
        if not (folders[name] / "adapter_model.safetensors").exists():
            raise SystemExit(f"peft did not write {folders[name]}")
    return peft_model.eval(), folders


def pool_budget(folders: dict[str, Path]) -> int:
    """The adapter pool's bytes: 1 GiB (--lora-memory-gb's default), or twice the adapters' fp32 files where
    that is more (the real-size checkpoint's 64 adapters), so that every row's adapter is resident at once."""
    files = sum((f / "adapter_model.safetensors").stat().st_size for f in folders.values())
    return max(2**30, 2 * files)


class Engine:
    """The in-process engine as the decoder service runs it on CPU on the checkpoint `model`, with its adapter
    pool (pool_budget's bytes) when `folders` is given."""

    def __init__(self, folders: dict[str, Path] | None, dtype: str = "fp32", targets: tuple[str, ...] = TARGETS,
                 rank: int = RANK, num_blocks: int = 2048, model: Path = SMOLLM2):
        self.runner = Runner.from_folder(model, dtype, 16, num_blocks)
        self.registry = None
        leases = None
        if folders is not None:
            pool = AdapterPool(self.runner.model, targets, pool_budget(folders), rank)
            self.runner.attach_lora(pool)
            self.registry = AdapterRegistry(pool, len(folders))
            for name, folder in folders.items():
                self.registry.register(name, load_peft(folder, layers=pool.shapes, max_rank=rank, dtype=pool.dtype))
            leases = AdapterLeases(self.registry)
        # Prefix caching off: the same prompts run several times and must cost the same each time.
        self.core = EngineCore(self.runner, EngineConfig(
            block_size=16, num_blocks=num_blocks, max_num_batched_tokens=512, max_num_seqs=64, max_model_len=2048,
            enable_prefix_caching=False), leases=leases)
        self.runs = 0

    def generate(self, batch: list[list[int]], adapters: list[str | None], max_tokens: int):
        """All rows at once; (outputs, end-to-end tok/s, decode tok/s)."""
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.runs += 1
        rids = [f"r{self.runs}-{i}" for i in range(len(batch))]
        out = {rid: [] for rid in rids}
        start = time.perf_counter()
        for rid, prompt, name in zip(rids, batch, adapters, strict=True):
            adapter, keys = adapter_request(name, self.registry.status(name).digest) if name else (None, ())
            self.core.add_request(rid, prompt, sp, adapter=adapter, extra_keys=keys)
        decode_start, decode_tokens = None, 0
        while self.core.has_unfinished():
            step_tokens = 0
            for o in self.core.step():
                out[o.request_id].extend(o.new_token_ids)
                step_tokens += len(o.new_token_ids)
            if decode_start is not None:
                decode_tokens += step_tokens
            elif all(out.values()):
                decode_start = time.perf_counter()  # every row has its first token: pure decode from here
        end = time.perf_counter()
        outputs = [out[rid] for rid in rids]
        return outputs, sum(map(len, outputs)) / (end - start), decode_tokens / (end - decode_start)


@torch.inference_mode()
def peft_generate(model, batch: list[list[int]], adapters: list[str | None], max_tokens: int):
    """peft's mixed-adapter batch: one left-padded generate with adapter_names; (outputs, tok/s)."""
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    start = time.perf_counter()
    gen = model.generate(input_ids=ids, attention_mask=mask, adapter_names=[a or "__base__" for a in adapters],
                         max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - start
    outputs = gen[:, width:].tolist()
    return outputs, sum(map(len, outputs)) / seconds


def peft_part(args, tag: str, what: str, peft_model, batch, adapters, mine, e2e: float, name: str) -> list[str]:
    """peft's mixed-adapter generate on the rows tessera ran (outputs `mine`, `e2e` tok/s end to end): prints the
    line `tag` and returns the ratio [name=tessera/peft], or [] with --no-peft."""
    if args.no_peft:
        print(f"{tag} peft skipped (--no-peft)")
        return []
    theirs, peft_tps = peft_generate(peft_model, batch, adapters, args.max_tokens)
    print(f"{tag} peft mixed-adapter generate{what}: {peft_tps:.1f} tok/s end to end vs tessera {e2e:.1f} tok/s; "
          f"identical greedy outputs {agreement(mine, theirs):.0%} of rows")
    return [f"{name}={e2e / peft_tps:.2f}x"]


def run_vllm(batch, adapters, folders, max_tokens: int, threads: int, model: Path = SMOLLM2) -> dict:
    job = {"prompts": batch, "adapters": adapters, "folders": {n: str(f) for n, f in folders.items()}}
    return run_vllm_peer("vllm_lora.py", ["--max-tokens", str(max_tokens)], job, threads, model=model)


def mixed_part(args) -> list[str]:
    """(a)-(c): `--rows` rows round-robin over `--adapters` rank-16 adapters on q/k/v/o, fp32."""
    batch = prompts(args.rows)
    names = [f"a{i}" for i in range(args.adapters)]
    mixed = [names[i % len(names)] for i in range(len(batch))]
    ratios = []
    with tempfile.TemporaryDirectory(prefix="tessera-bench-lora-") as tmp:
        peft_model, folders = make_adapters(Path(tmp), args.adapters, model=args.model)
        print(f"{args.shape}: {len(batch)} rows over {len(folders)} random rank-{RANK} adapters on "
              f"{','.join(TARGETS)}; {args.max_tokens} new tokens per row; fp32, {args.threads} threads")
        lora, base = Engine(folders, model=args.model), Engine(None, model=args.model)
        best_lora, best_base, ratio = best_of(lora, base, batch, mixed, args.max_tokens, rounds=3)
        mine, e2e, decode = best_lora
        print(f"(a) tessera decode: {decode:.1f} tok/s with {len(names)} adapters mixed, {best_base[2]:.1f} tok/s "
              f"with none (median pair {ratio:.2f}; end to end {e2e:.1f} vs {best_base[1]:.1f} tok/s)")
        ratios.append(f"adapter_overhead={ratio:.2f}")
        del base

        # (b) peft's mixed-adapter generate on the same rows.
        ratios += peft_part(args, "(b)", "", peft_model, batch, mixed, mine, e2e, "vs_peft")
        del peft_model, lora

        if args.no_peer:
            print("(c) vLLM skipped (--no-peer)")
        else:
            peer = run_vllm(batch, mixed, folders, args.max_tokens, args.threads, args.model)
            print(f"(c) vLLM enable_lora, a LoRARequest per row: {peer['lora']['tok_s']:.1f} tok/s end to end vs "
                  f"tessera {e2e:.1f} tok/s; identical outputs {agreement(mine, peer['lora']['outputs']):.0%} of "
                  f"rows; vLLM's own overhead {peer['lora']['tok_s'] / peer['base']['tok_s']:.2f} "
                  f"({peer['base']['tok_s']:.1f} tok/s without LoRARequests)")
            ratios.append(f"vs_vllm={e2e / peer['lora']['tok_s']:.2f}x")
    return ratios


def best_of(lora: Engine, base: Engine, batch, adapters, max_tokens: int, rounds: int = 2):
    """Warm both engines, then alternate them `rounds` times; each one's best (outputs, e2e, decode), and the
    median over the rounds of lora's decode tokens/s over base's in the same round (a burst on a shared machine
    then moves one pair, not the best of one side only)."""
    lora.generate(batch[:4], adapters[:4], 4)
    base.generate(batch[:2], [None] * len(batch[:2]), 4)
    best_lora = best_base = None
    paired = []
    for _ in range(rounds):
        mine = lora.generate(batch, adapters, max_tokens)
        best_lora = mine if best_lora is None or mine[2] > best_lora[2] else best_lora
        ref = base.generate(batch, [None] * len(batch), max_tokens)
        best_base = ref if best_base is None or ref[2] > best_base[2] else best_base
        paired.append(mine[2] / ref[2])
    return best_lora, best_base, statistics.median(paired)


# (label, targets, ranks): the measured adapters (q/v, rank 8), and attention + MLP at ranks 8 and 16.
DISTINCT = (("qv_r8", ("q_proj", "v_proj"), (8,)), ("all_r8_16", ALL_TARGETS, (8, 16)))


def adapter_bytes(runner: Runner, targets: tuple[str, ...], ranks: tuple[int, ...], rows: int) -> float:
    """Bytes of adapter rows one decode step of `rows` rows on distinct adapters reads (ranks cycled), in MB,
    against the model's projection weights (read once per step whatever the row count)."""
    mods = [m for name, m in runner.model.named_modules() if name.rsplit(".", 1)[-1] in targets
            and hasattr(m, "in_features")]
    per_rank = sum((m.in_features + m.out_features) * m.weight.element_size() for m in mods)
    return sum(ranks[i % len(ranks)] for i in range(rows)) * per_rank / 1e6


def distinct_part(args) -> list[str]:
    """(d)-(f): every row on its own adapter, for each of DISTINCT."""
    count = 64
    batch = prompts(count)
    names = [f"a{i}" for i in range(count)]
    ratios = []
    bandwidth = read_bandwidth()
    print(f"(d) this process reads memory at {bandwidth / 1e9:.1f} GB/s (torch.sum over 256 MiB, best of 5): a "
          f"step's adapter rows, read at that rate (or at a base step's own, where faster) on top of the base step, "
          f"cap each ratio at 'cap'; 'rows at' is the rate the adapter rows took in fact (their bytes over the "
          f"step's added time), 'bus' the share of that rate the base step's own weights take (the rest is time "
          f"the adapter reads could overlap)")
    for label, targets, ranks in DISTINCT:
        with tempfile.TemporaryDirectory(prefix="tessera-bench-lora-") as tmp:
            peft_model, folders = make_adapters(Path(tmp), count, ranks=ranks, targets=targets, model=args.model)
            if args.no_peft:
                peft_model = None             # its base and adapters are the largest thing held here
            print(f"(d) {args.shape}, every row on its own adapter: {count} random adapters of rank "
                  f"{' and '.join(map(str, ranks))} on {','.join(targets)}; {args.max_tokens} new tokens per row; "
                  f"{args.threads} threads")
            mine = e2e = None
            for dtype in ("fp32", "bf16"):
                lora = Engine(folders, dtype, targets, max(ranks), model=args.model)
                base = Engine(None, dtype, model=args.model)
                weights = sum(p.numel() * p.element_size() for p in base.runner.model.parameters())  # bytes
                runs = {}
                for rows in (1, 4, 64):
                    # A 1- or 4-row run is a fraction of a second: more rounds, so a burst on a shared machine
                    # does not decide its best.
                    runs[rows] = best_of(lora, base, batch[:rows], names[:rows], args.max_tokens,
                                         rounds=3 if rows == count else 6)
                # The probe ran once, at the start, and the machine's rate moves between minutes: a base step that
                # read its weights faster says the rate is at least that.
                rate = max([bandwidth] + [weights * ref[2] / rows for rows, (_, ref, _) in runs.items()])
                cells = []
                for rows, (got, ref, ratio) in runs.items():
                    step = rows / ref[2]                  # seconds of one base decode step
                    extra = adapter_bytes(lora.runner, targets, ranks, rows) * 1e6
                    cap = step / (step + extra / rate)
                    added = rows / got[2] - step
                    took = f"{extra / added / 1e9:.1f} GB/s" if added > 0 else "no added time"
                    cells.append(f"{rows} rows {got[2]:.1f} vs {ref[2]:.1f} tok/s (median pair {ratio:.2f}, "
                                 f"cap {cap:.2f}; rows at {took}, bus {weights / step / rate:.2f})")
                    ratios.append(f"{label}_{dtype}_{rows}={ratio:.2f}")
                    CAPS[f"{label}_{dtype}_{rows}"] = cap
                if dtype == "fp32":
                    mine, e2e = runs[count][0][:2]
                print(f"(d) {dtype} decode, {count} distinct adapters vs none: " + "; ".join(cells) +
                      " (goal >= 0.9 at 64 rows, >= 0.85 at 1-4); a 64-row step reads "
                      f"{adapter_bytes(lora.runner, targets, ranks, count):.0f} MB of adapter rows beside the "
                      f"model's {weights / 1e6:.0f} MB of weights")
                del lora, base
            ratios += peft_part(args, "(e)", f", {count} adapters", peft_model, batch, names, mine, e2e,
                                f"{label}_vs_peft")
            peft_model = None
            if args.no_peer:
                print("(f) vLLM skipped (--no-peer)")
            else:
                job = {"prompts": batch, "adapters": names, "folders": {n: str(f) for n, f in folders.items()},
                       "max_loras": count, "max_cpu_loras": count, "max_lora_rank": max(ranks)}
                peer = run_vllm_peer("vllm_lora.py", ["--max-tokens", str(args.max_tokens)], job, args.threads,
                                     model=args.model)
                print(f"(f) vLLM enable_lora, max_loras {count}: {peer['lora']['tok_s']:.1f} tok/s end to end vs "
                      f"tessera {e2e:.1f}; vLLM's own ratio {peer['lora']['tok_s'] / peer['base']['tok_s']:.2f}; "
                      f"identical outputs {agreement(mine, peer['lora']['outputs']):.0%} of rows")
                ratios.append(f"{label}_vs_vllm={e2e / peer['lora']['tok_s']:.2f}x")
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("mixed", "distinct", "zipf", "all"), default="all",
                    help="mixed: (a)-(c); distinct: (d)-(f), 64 rows on 64 adapters; zipf: (z), 1,000 adapters")
    ap.add_argument("--rows", type=int, default=32, help="(a)-(c) rows")
    ap.add_argument("--adapters", type=int, default=8, help="(a)-(c) adapters")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per row (as bench/decoder.py)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for every engine")
    ap.add_argument("--no-peer", action="store_true", help="skip the vLLM peer")
    ap.add_argument("--no-peft", action="store_true", help="skip peft's generate ((b) and (e))")
    ap.add_argument("--real-layers", type=int, default=0,
                    help="run every part on the Llama-3.2-1B-shaped checkpoint with this many layers "
                         f"(bench/real_checkpoint.py, {real_checkpoint.LAYERS} is the real depth); 0: SmolLM2")
    ap.add_argument("--registered", type=int, default=1000, help="(z) adapters on disk")
    ap.add_argument("--requests", type=int, default=512, help="(z) requests")
    ap.add_argument("--clients", type=int, default=64, help="(z) concurrent clients")
    ap.add_argument("--zipf", type=float, default=1.1, help="(z) Zipf exponent of the adapter popularity")
    ap.add_argument("--rank", type=int, default=8, help="(z) adapter rank")
    ap.add_argument("--lora-memory-gb", type=float, default=1.0, help="(z) the decoder's adapter budget")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.real_layers:
        args.model = real_checkpoint.write(args.real_layers, SMOLLM2)
        args.shape = f"Llama-3.2-1B shape, {args.real_layers} layers, random weights ({args.model.name})"
    else:
        args.model, args.shape = SMOLLM2, SMOLLM2.name
    cpu = cpu_line()
    print(f"CPU: {cpu}; model: {args.shape}")
    ratios = []
    if args.part in ("mixed", "all"):
        ratios += mixed_part(args)
    if args.part in ("distinct", "all"):
        ratios += distinct_part(args)
    if args.part in ("zipf", "all"):
        ratios += zipf_part(args, prompts, run_vllm_peer)
    print(f"goals ({cpu}; {args.shape}): " + ("; ".join(verdicts(ratios)) or "none measured by this part"))
    print(f"ratios ({cpu}; {args.shape}): " + " ".join(ratios))


# The goals over the ratios' names: decode with every row on its own adapter at 64 rows, and at 1 and 4; the Zipf
# traffic over 1,000 adapters; 8 adapters mixed over 32 rows against none, and against peft end to end.
GOALS = ((re.compile(r"_(fp32|bf16)_64$"), 0.9), (re.compile(r"_(fp32|bf16)_[14]$"), 0.85),
         (re.compile(r"^zipf_of_base$"), 0.8), (re.compile(r"^adapter_overhead$"), 0.8),
         (re.compile(r"^vs_peft$"), 3.0))


# ratio name -> the most that reading its adapter rows at the measured bandwidth leaves (distinct_part)
CAPS: dict[str, float] = {}


def verdicts(ratios: list[str]) -> list[str]:
    """'NAME VALUE>=GOAL met' (or '<GOAL missed', with the ratio's cap when that is below the goal too) for each
    ratio that a goal names."""
    out = []
    for item in ratios:
        name, _, value = item.partition("=")
        for pattern, goal in GOALS:
            if pattern.search(name):
                got = float(value.rstrip("x"))
                cap = CAPS.get(name)
                out.append(f"{name} {got:.2f}>={goal} met" if got >= goal else
                           f"{name} {got:.2f}<{goal} missed" + (f" (cap {cap:.2f})" if cap and cap < goal else ""))
    return out


if __name__ == "__main__":
    main()
