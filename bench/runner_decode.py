"""Quick runner-level decode check: tessera's Runner vs transformers' generate, same random model.

A SmolLM2-135M-shaped Llama with random weights (no hub), fp32 or bf16, greedy. Measures batch-1 and
16-request decode tokens/s end to end (prefill included for both). Not the issue's full
benchmark (bench/decoder.py drives the engine); this isolates the model/attention/runner.

    .venv/bin/python bench/runner_decode.py [--threads 2] [--new 64] [--prompt 64] [--dtype fp32|bf16]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.decoder.engine.step import SamplingParams, ScheduledChunk, StepInput  # noqa: E402
from services.decoder.runner import Runner  # noqa: E402


def write_model(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                      max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)


def ours(runner: Runner, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    bs, greedy = runner.block_size, SamplingParams(temperature=0)
    tables, seqs, free = [], [list(p) for p in prompts], iter(range(runner.num_blocks))
    for p in prompts:
        tables.append([next(free) for _ in range(-(-(len(p) + new) // bs))])
    start = time.perf_counter()
    chunks = [ScheduledChunk(str(i), s, 0, tables[i], True, greedy) for i, s in enumerate(seqs)]
    for _ in range(new):
        out = runner.execute(StepInput(chunks))
        for i, s in enumerate(seqs):
            s.append(out.sampled[str(i)].token_id)
        chunks = [ScheduledChunk(str(i), [s[-1]], len(s) - 1, tables[i], True, greedy) for i, s in enumerate(seqs)]
    return time.perf_counter() - start, [s[len(p):] for s, p in zip(seqs, prompts, strict=True)]


def hf(model, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=0)
    return time.perf_counter() - start, out[:, ids.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp))
        runner = Runner.from_folder(tmp, args.dtype, block_size=16, num_blocks=2048)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        ref = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, 49152, (args.batch, args.prompt), generator=g).tolist()
    ours(runner, prompts[:1], 4)                                 # warm-up both
    hf(ref, prompts[:1], 4)
    for batch in (1, args.batch):
        t_ours, toks_ours = ours(runner, prompts[:batch], args.new)
        t_hf, toks_hf = hf(ref, prompts[:batch], args.new)
        same = sum(a == b for a, b in zip(toks_ours, toks_hf, strict=True))
        n = batch * args.new
        print(f"batch {batch:2d}: tessera {n / t_ours:7.1f} tok/s   transformers {n / t_hf:7.1f} tok/s   "
              f"ratio {t_hf / t_ours:4.2f}x   identical outputs {same}/{batch}")


if __name__ == "__main__":
    main()
