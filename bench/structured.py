"""Structured-output benchmark: 64 json_schema chat requests vs the same 64 unconstrained, side by side.

Workload: SmolLM2-135M-Instruct, 64 chat prompts asking for a JSON profile, all submitted at once
to the in-process engine (core + runner, as the decoder service runs it), greedy, 2 threads.

  (a) throughput: the constrained run uses a json_schema grammar (a nested object with a string, an
      integer, an array of at most 4 strings, an enum and a nested object); the unconstrained run is the
      same prompts with max_tokens set to the length each constrained request reached (EOS ignored), so
      both runs schedule exactly the same token counts and the ratio isolates the cost of the grammar
      (mask fill, mask apply, matcher advance). Rounds alternate which side runs first; the best round
      of each counts.
  (b) p50 time to first token, grammar compile included, on an idle engine without prefix caching (each
      sample pays the same prefill): a schema seen for the first time (each sample a new schema: a
      property renamed), then the same schema again (a compile cache hit), and an unconstrained request.

The last line printed holds the constrained / unconstrained throughput ratio (goal >= 0.9).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workload import SMOLLM2  # noqa: E402
from services.decoder.engine.config import EngineConfig  # noqa: E402
from services.decoder.engine.engine_core import EngineCore  # noqa: E402
from services.decoder.engine.step import SamplingParams  # noqa: E402
from services.decoder.grammar.compiled import Grammar  # noqa: E402
from services.decoder.grammar.compiler import GrammarCompiler  # noqa: E402
from services.decoder.grammar.spec import GrammarSpec  # noqa: E402
from services.decoder.runner.runner import Runner  # noqa: E402
from services.decoder.text.chat_template import ChatTemplate  # noqa: E402
from services.decoder.text.tokenizer import Tokenizer  # noqa: E402

PEOPLE = ["a nurse in Lyon", "a retired pilot", "a chess coach", "a baker in Osaka", "a marine biologist",
          "a bus driver", "a violin maker", "a data engineer"]
TRAITS = ["who loves hiking", "who speaks three languages", "with two cats", "who just moved abroad",
          "who runs marathons", "who collects stamps", "who writes poetry", "who grows tomatoes"]


def schema(key: str = "name") -> dict:
    return {"type": "object", "properties": {
        key: {"type": "string"}, "age": {"type": "integer"},
        # Bounded: greedy SmolLM2 repeats a list item until any budget runs out.
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "role": {"enum": ["engineer", "manager", "designer", "analyst", "other"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                    "required": ["city", "country"]}},
        "required": [key, "age", "skills", "role", "address"]}


class Bench:
    def __init__(self, dtype: str, threads: int, max_seqs: int = 64):
        self.tok = Tokenizer.from_folder(SMOLLM2)
        self.template = ChatTemplate.from_folder(SMOLLM2, self.tok)
        self.runner = Runner.from_folder(SMOLLM2, dtype, 16, 4096)
        self.cfg = EngineConfig(block_size=16, num_blocks=4096, max_num_batched_tokens=2048, max_num_seqs=max_seqs,
                                max_model_len=4096, eos_token_ids=tuple(dict.fromkeys(
                                    (*self.runner.eos_token_ids, *self.tok.stop_token_ids))))
        self.core = EngineCore(self.runner, self.cfg)
        # TTFT is measured without the prefix cache, so every sample pays the same prefill.
        self.cold = EngineCore(self.runner, replace(self.cfg, enable_prefix_caching=False))
        self.compiler = GrammarCompiler(self.tok.backend, vocab_size=self.runner.vocab_size,
                                        stop_token_ids=self.cfg.eos_token_ids,
                                        special_token_ids=self.tok.all_special_ids, threads=threads)
        self._ids = 0

    def prompt(self, i: int) -> list[int]:
        who = f"{PEOPLE[i % len(PEOPLE)]} {TRAITS[i // len(PEOPLE) % len(TRAITS)]}"
        messages = [{"role": "user", "content": f"Write a JSON profile of {who}: name, age, skills, role, address."}]
        return self.template.encode(self.tok, messages, add_generation_prompt=True)

    def run(self, jobs: list[tuple[list[int], SamplingParams, Grammar | None]]) -> tuple[list[list[int]], float]:
        """All jobs at once; (outputs without the stop token, seconds)."""
        tag = f"r{self._ids}-"
        self._ids += 1
        out = {f"{tag}{i}": [] for i in range(len(jobs))}
        start = time.perf_counter()
        for i, (prompt, params, grammar) in enumerate(jobs):
            self.core.add_request(f"{tag}{i}", prompt, params, grammar=grammar)
        while self.core.has_unfinished():
            for o in self.core.step():
                out[o.request_id].extend(t for t in o.new_token_ids if o.stop_token_id is None or t != o.stop_token_id)
        return [out[f"{tag}{i}"] for i in range(len(jobs))], time.perf_counter() - start

    def ttft(self, prompt: list[int], spec: GrammarSpec | None) -> float:
        """Seconds from the request's arrival (compile included) to its first token, on an idle engine."""
        rid = f"t{self._ids}"
        self._ids += 1
        start = time.perf_counter()
        grammar = self.compiler.compile_now(spec) if spec is not None else None
        self.cold.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1), grammar=grammar)
        while self.cold.has_unfinished():
            self.cold.step()
        return time.perf_counter() - start


def valid(text: str, s: dict) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), s)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=160, help="budget of a constrained request")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (and grammar threads)")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--ttft-samples", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    b = Bench(args.dtype, args.threads, max_seqs=args.requests)
    prompts = [b.prompt(i) for i in range(args.requests)]
    b.run([(prompts[0], SamplingParams(temperature=0.0, max_tokens=4), None)])        # warm up

    # (b) first, on an idle engine; the three kinds interleave so that load on the machine hits them alike.
    first, cached, plain = [], [], []
    for i in range(args.ttft_samples):
        spec = GrammarSpec.json_schema(json.dumps(schema(f"name_{i}")))
        first.append(b.ttft(prompts[i], spec))
        cached.append(b.ttft(prompts[i], spec))
        plain.append(b.ttft(prompts[i], None))
    compile_ms = []
    for i in range(args.ttft_samples):
        start = time.perf_counter()
        b.compiler.compile_now(GrammarSpec.json_schema(json.dumps(schema(f"compile_{i}"))))
        compile_ms.append((time.perf_counter() - start) * 1e3)

    # (a)
    grammar = b.compiler.compile_now(GrammarSpec.json_schema(json.dumps(schema())))
    constrained_jobs = [(p, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), grammar)
                        for p in prompts]
    outs, _ = b.run(constrained_jobs)
    lengths = [max(1, len(o)) for o in outs]
    ok = sum(valid(b.tok.decode(o), schema()) for o in outs)
    print(f"(a) constrained outputs: {ok}/{len(outs)} parse and validate; {sum(lengths)} tokens "
          f"(mean {sum(lengths) / len(outs):.1f}, {sum(n >= args.max_tokens for n in lengths)} cut by max_tokens)")
    print(f"    e.g. {b.tok.decode(outs[0])[:160]}")
    free = [(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), None)
            for p, n in zip(prompts, lengths, strict=True)]
    best_c = best_u = 0.0
    pairs = []
    for r in range(args.rounds):
        # Alternate which side goes first, so a load spike does not always land on the same one.
        order = (("constrained", constrained_jobs), ("unconstrained", free))
        tps = {}
        for name, jobs in order if r % 2 == 0 else order[::-1]:
            got, secs = b.run(jobs)
            tps[name] = sum(len(o) for o in got) / secs
        pairs.append(tps["constrained"] / tps["unconstrained"])
        print(f"(a) round {r + 1}: constrained {tps['constrained']:.1f} tok/s, unconstrained "
              f"{tps['unconstrained']:.1f} tok/s, same token counts; ratio {pairs[-1]:.3f}")
        best_c, best_u = max(best_c, tps["constrained"]), max(best_u, tps["unconstrained"])
    med = statistics.median
    print(f"(b) p50 TTFT (idle engine, {args.ttft_samples} samples each): new schema {med(first) * 1e3:.1f} ms, "
          f"cached schema {med(cached) * 1e3:.1f} ms, unconstrained {med(plain) * 1e3:.1f} ms; "
          f"compile alone p50 {med(compile_ms):.1f} ms")
    print(f"(a) best rounds: constrained {best_c:.1f} tok/s, unconstrained {best_u:.1f} tok/s "
          f"({args.dtype}, {args.threads} threads, {args.requests} requests); median round ratio "
          f"{med(pairs):.3f}; load average {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"ratio: constrained/unconstrained throughput={best_c / best_u:.3f}")
    b.compiler.close()


if __name__ == "__main__":
    main()
