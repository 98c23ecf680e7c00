"""Quality of the quantized formats: perplexity and top-1 agreement with bf16, tessera beside llama.cpp.

SmolLM2-135M-Instruct's real weights (models/, docs/models.md), over real English text available offline:
gensim's Lee background corpus (news articles, packaged test data). Both engines score the same tokens by
llama.cpp's own perplexity protocol (tools/perplexity): the text in --chunks windows of --ctx tokens, each
window evaluated alone (a BOS in place of its first token where the GGUF adds one), every position of its
second half predicting the next token.

  llama.cpp: `llama-perplexity` on the BF16 GGUF writes its log-probabilities and tokens once
             (--kl-divergence-base), then each of Q8_0 and Q4_0 (made from the BF16 file by llama-quantize)
             runs --kl-divergence against them: its perplexity, mean KL divergence and "Same top p" (the
             top-1 token agreeing with BF16's). llama-quantize's Q4_0 keeps the tied head/embedding table at
             Q8_0 here (SmolLM2's width 576 is no multiple of Q6_K's 256), as its recipe does. llama-server
             returns no log-probabilities of prompt tokens (no echo), which teacher forcing needs, so this is
             llama.cpp's own tool for exactly this.
  tessera:   the runner in this process, teacher forced on llama.cpp's tokens (read back from that file):
             one step per window whose chunk carries the window's tokens as drafts, so the runner returns
             the fp32 logits of every position (runner.logits); bf16, int8 (--quantization int8) and int4
             (where this tree has it) against tessera's bf16; and, where this tree serves GGUF files, tessera
             on llama.cpp's Q8_0 and Q4_0 files themselves ("Q4_0 file": the very weights llama.cpp ran).

bits/weight is measured: the bytes of the weights a decode step reads over their count (tessera: the
projections and the tied head in the form they compute with; llama.cpp: the GGUF's tensors). The table is
the last thing printed.
"""
from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decoder import VARIANTS, linear_bytes  # noqa: E402
from bench.peers import llamacpp  # noqa: E402
from bench.workload import ROOT, SMOLLM2, package_dir  # noqa: E402
from services.common.errors import TesseraError  # noqa: E402
from services.decoder.engine.step import SamplingParams, ScheduledChunk, StepInput  # noqa: E402
from services.decoder.runner.runner import Runner  # noqa: E402
from services.decoder.text.tokenizer import Tokenizer  # noqa: E402

LLAMA_PERPLEXITY = llamacpp.LLAMA_SERVER.with_name("llama-perplexity")
WORK = ROOT / "build" / "bench" / "quality"
FORMATS = {"tessera": ("bf16", "int8", "int4"), "llama.cpp": ("BF16", "Q8_0", "Q4_0")}


@dataclass
class Row:
    """One line of the table."""
    engine: str
    fmt: str
    bits: float
    ppl: float
    top1: float          # fraction of scored positions whose argmax is bf16's
    kld: float           # mean KL(bf16 || this format), nats


def text_file() -> Path:
    """The Lee background corpus as UTF-8 text for llama-perplexity -f."""
    src = package_dir("gensim") / "test" / "test_data" / "lee_background.cor"
    out = WORK / "lee_background.txt"
    if not out.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        out.write_text(src.read_text(encoding="latin-1"), encoding="utf-8")
    return out


def perplexity_tool(args: list[str]) -> str:
    """llama-perplexity's output. Its CPU weight repacking segfaults on Q8_0 and Q4 types on an Intel Xeon with
    AMX (family 6 model 167), as llama-server's does (bench/peers/llamacpp.py): a run killed by a signal is
    retried once with --no-repack, and the output says so."""
    proc = subprocess.run([str(LLAMA_PERPLEXITY), *args], capture_output=True, text=True, check=False)
    if proc.returncode < 0:
        print(f"llama-perplexity crashed (signal {-proc.returncode}) on {args[1]}; retrying with --no-repack")
        proc = subprocess.run([str(LLAMA_PERPLEXITY), *args, "--no-repack"], capture_output=True, text=True,
                              check=False)
    if proc.returncode != 0:
        raise SystemExit(f"llama-perplexity {' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def number(pattern: str, log: str) -> float:
    m = re.search(pattern, log)
    if m is None:
        raise SystemExit(f"llama-perplexity printed no {pattern!r}:\n{log[-3000:]}")
    return float(m.group(1))


def base_tokens(path: Path) -> tuple[int, list[list[int]]]:
    """(n_ctx, the windows' tokens) from a --kl-divergence-base file: "_logits_", int32 n_ctx, n_vocab, n_chunk,
    then n_chunk * n_ctx int32 tokens (tools/perplexity/perplexity.cpp)."""
    with path.open("rb") as f:
        if f.read(8) != b"_logits_":
            raise SystemExit(f"{path} is not a llama-perplexity logits file")
        n_ctx, _, n_chunk = np.frombuffer(f.read(12), dtype=np.int32).tolist()
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype=np.int32)
    return n_ctx, tokens.reshape(n_chunk, n_ctx).tolist()


def llama_rows(files: dict[str, Path], txt: Path, ctx: int, chunks: int, threads: int) -> tuple[list[Row], Path]:
    """llama.cpp's rows; the base file (its tokens)."""
    base = WORK / f"{files['BF16'].stem}-c{ctx}-n{chunks}.kld"
    common = ["-c", str(ctx), "-t", str(threads), "-tb", str(threads), "-b", str(ctx)]
    log = perplexity_tool(["-m", str(files["BF16"]), "-f", str(txt), "--chunks", str(chunks),
                           "--kl-divergence-base", str(base), *common])
    rows = [Row("llama.cpp", "BF16", bits(files["BF16"]), number(r"Final estimate: PPL = ([\d.]+)", log), 1.0, 0.0)]
    for fmt in FORMATS["llama.cpp"][1:]:
        if fmt not in files:
            continue
        log = perplexity_tool(["-m", str(files[fmt]), "--kl-divergence-base", str(base), "--kl-divergence", *common])
        rows.append(Row("llama.cpp", fmt, bits(files[fmt]), number(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", log),
                        number(r"Same top p:\s*([\d.]+)", log) / 100, number(r"Mean\s+KLD:\s*([\d.]+)", log)))
    return rows, base


def bits(gguf: Path) -> float:
    size, weights = llamacpp.tensor_bytes(gguf)
    return size * 8 / weights


def add_bos(gguf: Path) -> tuple[bool, int]:
    """(whether llama.cpp puts a BOS first in each window, the BOS id), from the GGUF's tokenizer metadata."""
    from gguf import GGUFReader
    fields = GGUFReader(str(gguf)).fields

    def scalar(key: str, default):
        f = fields.get(key)
        return default if f is None else f.parts[f.data[0]].tolist()[0]
    return bool(scalar("tokenizer.ggml.add_bos_token", False)), int(scalar("tokenizer.ggml.bos_token_id", -1))


@torch.inference_mode()
def window_logprobs(runner: Runner, tokens: list[int]) -> torch.Tensor:
    """Log-probabilities [len(tokens), vocab] (fp32) of the next token at every position of one window, from a
    cold cache: one chunk whose last len - 1 tokens are drafts, so every row is returned (runner.logits)."""
    blocks = list(range(-(-len(tokens) // runner.block_size)))
    chunk = ScheduledChunk("window", list(tokens), 0, blocks, True, SamplingParams(temperature=0.0),
                           num_prompt_tokens=len(tokens), prompt_token_ids=tokens, draft_token_ids=list(tokens[1:]))
    logits, _ = runner.logits(StepInput([chunk]))
    return torch.log_softmax(logits.float(), dim=-1)


def tessera_rows(windows: list[list[int]], threads: int, files: dict[str, Path]) -> list[Row]:
    """tessera's rows: each format's perplexity, top-1 agreement and mean KL divergence against its bf16; then
    tessera serving llama.cpp's quantized GGUF files themselves (`--model file.gguf`), where this tree can."""
    torch.set_num_threads(threads)
    ctx = len(windows[0])
    first = ctx // 2
    sources = [(fmt, SMOLLM2, *VARIANTS[fmt]) for fmt in FORMATS["tessera"]]
    sources += [(f"{fmt} file", files[fmt], "fp32", "none") for fmt in FORMATS["llama.cpp"][1:] if fmt in files]
    runners = {}
    for fmt, model, dtype, quantization in sources:
        try:
            runners[fmt] = Runner.from_folder(model, dtype, 16, -(-ctx // 16) + 1, quantization=quantization)
        except (TesseraError, ValueError) as e:
            print(f"tessera {fmt}: not available in this tree ({str(e).splitlines()[0][:200]})")
    nll = {f: 0.0 for f in runners}
    same = {f: 0 for f in runners}
    kld = {f: 0.0 for f in runners}
    count = 0
    for w in windows:
        target = torch.tensor(w[first + 1:])
        ref = None
        for fmt, runner in runners.items():
            lp = window_logprobs(runner, w)[first:-1].double()
            nll[fmt] -= float(lp.gather(1, target[:, None]).sum())
            if ref is None:
                ref = lp
            same[fmt] += int((lp.argmax(1) == ref.argmax(1)).sum())
            kld[fmt] += float((ref.exp() * (ref - lp)).sum())
        count += len(target)
    out = []
    for fmt, runner in runners.items():
        sizes = [linear_bytes(m) for m in runner.model.modules() if isinstance(m, torch.nn.Linear)]
        weights = sum(n for b, n in sizes if b)
        out.append(Row("tessera", fmt, sum(b for b, _ in sizes) * 8 / weights, math.exp(nll[fmt] / count),
                       same[fmt] / count, kld[fmt] / count))
    return out


def gguf_files() -> tuple[dict[str, Path], str]:
    bf16 = llamacpp.GGUF["bf16"]
    for path in (LLAMA_PERPLEXITY, bf16):
        if not path.exists():
            return {}, f"{path} is missing: run `make bench-peers`"
    files, why = {"BF16": bf16}, ""
    if llamacpp.GGUF["int8"].exists():
        files["Q8_0"] = llamacpp.GGUF["int8"]
    for fmt in FORMATS["llama.cpp"][1:]:
        if fmt not in files:
            path, why = llamacpp.quantized(bf16, fmt)
            if path is not None:
                files[fmt] = path
    return files, why


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=512, help="tokens per window (llama-perplexity -c)")
    ap.add_argument("--chunks", type=int, default=16, help="windows scored (llama-perplexity --chunks)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads and llama-perplexity's -t")
    args = ap.parse_args()
    if args.ctx < 32 or args.ctx % 16 or args.chunks < 1:
        ap.error("--ctx must be a multiple of 16 of at least 32, --chunks at least 1")
    files, why = gguf_files()
    if "BF16" not in files or why:
        sys.exit(f"llama.cpp not run: {why}; quality.py scores llama.cpp's tokens, so it needs llama-perplexity")
    txt = text_file()
    llama, base = llama_rows(files, txt, args.ctx, args.chunks, args.threads)
    ctx, windows = base_tokens(base)
    bos, bos_id = add_bos(files["BF16"])
    ours = Tokenizer.from_folder(SMOLLM2).encode(txt.read_text(encoding="utf-8"), add_special_tokens=False)
    flat = [t for w in windows for t in w]
    differ = next((i for i, (a, b) in enumerate(zip(flat, ours, strict=False)) if a != b), None)
    print(f"{len(windows)} windows of {ctx} tokens of {txt.name}; llama.cpp's tokens "
          f"{'are' if differ is None else f'differ at token {differ} from'} tessera's tokenizer's"
          f"{f'; BOS {bos_id} first in each window' if bos else ''}")
    if bos:
        windows = [[bos_id, *w[1:]] for w in windows]
    rows = tessera_rows(windows, args.threads, files) + llama
    print(f"{'engine':<10} {'format':<11} {'bits/weight':>11} {'perplexity':>10} {'top-1 = bf16':>12} "
          f"{'mean KLD':>9}")
    for r in rows:
        print(f"{r.engine:<10} {r.fmt:<11} {r.bits:>11.2f} {r.ppl:>10.3f} {r.top1:>11.2%} {r.kld:>9.5f}")


if __name__ == "__main__":
    main()
