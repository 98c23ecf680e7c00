"""llama.cpp side of bench/decoder.py: a `llama-server` child process, driven over HTTP.

Built by `make bench-peers` (build/peers/, see the Makefile); runs in the main venv, standard
library only. The server listens on 127.0.0.1 on a free port and is always stopped on exit from
the `with` block, errors included. Prompts go to /completion as token ids: the same ids tessera
and vLLM get, so no chat template or tokenizer of llama.cpp's is involved.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = ROOT / "build" / "peers"
LLAMA_SERVER = PEERS_DIR / "llama.cpp-build" / "bin" / "llama-server"
LLAMA_QUANTIZE = PEERS_DIR / "llama.cpp-build" / "bin" / "llama-quantize"
GGUF = {
    "fp32": PEERS_DIR / "gguf" / "SmolLM2-135M-Instruct-F32.gguf",
    "bf16": PEERS_DIR / "gguf" / "SmolLM2-135M-Instruct-BF16.gguf",
    "int8": PEERS_DIR / "gguf" / "SmolLM2-135M-Instruct-Q8_0.gguf",   # against --quantization int8
    # against --quantization int4; llama-quantize writes it from the BF16 file (bench/quality.py makes it once)
    "int4": PEERS_DIR / "gguf" / "SmolLM2-135M-Instruct-Q4_0.gguf",
}


# The GGUF converter `make bench-peers` sets up (the Makefile's CONVERT_VENV and LLAMA_SRC, llama-cpp-python 0.3.36).
CONVERT_PYTHON = PEERS_DIR / ".venv-convert" / "bin" / "python"
CONVERTER = PEERS_DIR / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"


def convert_command(folder: Path, outtype: str) -> tuple[list[str], Path]:
    """(the command that converts an HF folder to GGUF in outtype, the file it writes) by llamacpp_convert.py."""
    from bench.peers.llamacpp_convert import gguf_name
    out = PEERS_DIR / "gguf"
    cmd = [str(CONVERT_PYTHON), str(ROOT / "bench" / "peers" / "llamacpp_convert.py"), "--src", str(folder),
           "--out", str(out), "--converter", str(CONVERTER), "--name", folder.name, "--outtypes", outtype]
    return cmd, out / gguf_name(folder.name, outtype)


def gguf_of(folder: Path, outtype: str) -> tuple[Path | None, str]:
    """(folder's GGUF in outtype, converted now if the converter is set up, or None; why not, or "")."""
    cmd, target = convert_command(folder, outtype)
    if not LLAMA_SERVER.exists():
        return None, f"{LLAMA_SERVER} is missing: run `make bench-peers`"
    if not target.exists():
        if not (CONVERT_PYTHON.exists() and CONVERTER.exists()):
            return None, f"{CONVERT_PYTHON} or {CONVERTER} is missing: run `make bench-peers`"
        subprocess.run(cmd, check=True)
    return target, ""


def quantized(src: Path, qtype: str) -> tuple[Path | None, str]:
    """(src, a GGUF file, quantized to qtype (Q8_0, Q4_0, Q4_K_M, ...) by llama-quantize, made now if missing,
    or None; why not, or ""). The file is src's name with its type replaced: X-BF16.gguf -> X-Q4_0.gguf."""
    stem = src.name.removesuffix(".gguf").rsplit("-", 1)[0]
    target = src.with_name(f"{stem}-{qtype}.gguf")
    if target.exists():
        return target, ""
    if not LLAMA_QUANTIZE.exists():
        return None, f"{LLAMA_QUANTIZE} is missing: run `make bench-peers`"
    tmp = target.with_suffix(".gguf.part")
    proc = subprocess.run([str(LLAMA_QUANTIZE), str(src), str(tmp), qtype], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"llama-quantize {src.name} {qtype} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    tmp.replace(target)
    return target, ""


def tensor_bytes(gguf: Path) -> tuple[int, int]:
    """(bytes of gguf's tensor data, weights in it): what a batch-1 step of llama.cpp reads, nearly all of it
    (a tied head reads the whole token_embd table; the norms are a few KB)."""
    from gguf import GGUFReader
    tensors = GGUFReader(str(gguf)).tensors
    return sum(int(t.n_bytes) for t in tensors), sum(int(t.n_elements) for t in tensors)


def require_built(dtype: str) -> Path:
    for path in (LLAMA_SERVER, GGUF[dtype]):
        if not path.exists():
            raise SystemExit(f"{path} is missing: run `make bench-peers`")
    return GGUF[dtype]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: SIGTERM when the bench process dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def server_flags() -> str:
    """`llama-server --help`, to check for flags this build may lack."""
    proc = subprocess.run([str(LLAMA_SERVER), "--help"], capture_output=True, text=True, check=False)
    return proc.stdout + proc.stderr


class Crashed(Exception):
    """llama-server died of a signal before it was healthy."""


class LlamaServer:
    """`with LlamaServer(model, ...) as srv:` starts llama-server and waits until it is healthy."""

    def __init__(self, model: Path, threads: int, parallel: int, ctx: int, kv_unified: bool | None = None,
                 startup_s: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(LLAMA_SERVER), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                    "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", str(ctx),
                    "--no-webui", "--no-warmup"]
        if kv_unified is not None:
            self.cmd.append("--kv-unified" if kv_unified else "--no-kv-unified")
        self.startup_s = startup_s
        self.repack = True                 # False once a crash at load made it retry with --no-repack
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile(mode="w+")

    def __enter__(self) -> LlamaServer:
        try:
            self._start()
        except Crashed as e:
            # b10573's CPU weight repacking segfaults on Q8_0 on an Intel Xeon with AMX (family 6 model 167,
            # 2026-12-03) before the server answers; without it the same GGUF serves. Say so and retry once.
            print(f"llama-server crashed while loading ({e}); retrying with --no-repack", file=sys.stderr)
            self.cmd.append("--no-repack")
            self.repack = False
            self._start()
        return self

    def _start(self) -> None:
        self.log.seek(0)
        self.log.truncate()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def tail(self, chars: int = 4000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-chars:]

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                if code < 0 and self.repack:
                    raise Crashed(f"signal {-code}")
                raise SystemExit(f"llama-server exited with {code}:\n{' '.join(self.cmd)}\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise SystemExit(f"llama-server not healthy after {self.startup_s:.0f}s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def complete(self, prompt: list[int], n_predict: int, timeout_s: float = 1800.0, cache_prompt: bool = True) -> dict:
        """Greedy, eos ignored, exactly n_predict tokens; the server's JSON (tokens, timings). cache_prompt
        False: the whole prompt is computed again (a time to first token)."""
        body = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "temperature": 0.0,
                "top_k": 1, "return_tokens": True, "stream": False, "cache_prompt": cache_prompt}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise SystemExit(f"llama-server /completion failed: {e.code} {e.read()[:2000]!r}\n{self.tail()}") from e

    def generate(self, batch: list[list[int]], n_predict: int) -> tuple[list[list[int]], float]:
        """All prompts at once, one HTTP request each; (outputs, wall seconds)."""
        with ThreadPoolExecutor(max_workers=len(batch)) as pool:
            start = time.perf_counter()
            results = list(pool.map(lambda p: self.complete(p, n_predict), batch))
            seconds = time.perf_counter() - start
        return [r["tokens"] for r in results], seconds

    def ttft(self, prompt: list[int]) -> float:
        """Seconds to the first token of prompt, none of it cached (wall clock of a 1-token request)."""
        start = time.perf_counter()
        done = self.complete(prompt, 1, cache_prompt=False)
        seconds = time.perf_counter() - start
        if done["timings"]["prompt_n"] != len(prompt):
            raise SystemExit(f"llama-server computed {done['timings']['prompt_n']} of {len(prompt)} prompt tokens "
                             "with cache_prompt false: not a cold time to first token")
        return seconds

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's own tokens of text (the GGUF's tokenizer, no special tokens added)."""
        req = urllib.request.Request(self.url + "/tokenize", data=json.dumps({"content": text}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["tokens"]

    def batch1(self, prompt: list[int], n_predict: int, repeats: int = 3) -> list[float]:
        """Decode tokens/s of one request alone, by the server's own timings (predicted_per_second)."""
        return [self.complete(prompt, n_predict)["timings"]["predicted_per_second"] for _ in range(repeats)]


def slot_ctx(batch: list[list[int]], max_tokens: int) -> int:
    """Per-slot context that holds the longest prompt + max_tokens, rounded up to 256."""
    need = max(map(len, batch)) + max_tokens
    return -(-need // 256) * 256


def run(dtype: str, batch: list[list[int]], max_tokens: int, threads: int, kv_modes: tuple[str, ...]) -> dict:
    """64-chat throughput in each KV mode and batch-1 decode, on F32 (fp32), BF16 (bf16) or Q8_0 (int8) GGUF.

    Returns {"modes": {mode: {"tok_s", "seconds", "outputs", "b1": [tok/s ...], "load": 1/5/15-min
    load average when the mode finished, "repack": False if it ran with --no-repack}}, "best": mode,
    "b1": best batch-1 tok/s over the modes, "ctx": ...}.
    """
    model = require_built(dtype)
    per_slot = slot_ctx(batch, max_tokens)
    ctx = per_slot * len(batch)
    modes = {}
    for mode in kv_modes:
        with LlamaServer(model, threads, len(batch), ctx, kv_unified=(mode == "unified")) as srv:
            srv.complete(batch[0], 4)                      # warm-up, as the vLLM side does
            outputs, seconds = srv.generate(batch, max_tokens)
            tokens = sum(map(len, outputs))
            b1 = srv.batch1(batch[0], max_tokens)
        modes[mode] = {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "outputs": outputs,
                       "b1": b1, "load": os.getloadavg(), "repack": srv.repack}
    best = max(modes, key=lambda m: modes[m]["tok_s"])
    return {"modes": modes, "best": best, "b1": max(max(m["b1"]) for m in modes.values()),
            "ctx": ctx, "per_slot": per_slot}


def batch1_rounds(dtype: str, prompt: list[int], max_tokens: int, threads: int, rounds: int,
                  ours: Callable[[str], float]) -> tuple[list[float], list[float]]:
    """Batch-1 decode on a one-slot llama-server, alternating with `ours` (one run of the other engine
    under a tag unique to the round, returning its tok/s): `rounds` runs each, so that a slow spell of a
    shared machine falls on both. Returns (llama.cpp's tok/s by the server's own timings, ours), one per round."""
    with LlamaServer(require_built(dtype), threads, 1, slot_ctx([prompt], max_tokens)) as srv:
        srv.complete(prompt, 4)                            # warm-up
        theirs, mine = [], []
        for i in range(rounds):
            theirs.extend(srv.batch1(prompt, max_tokens, repeats=1))
            mine.append(ours(f"alt{i}"))
    return theirs, mine


def kv_modes_supported() -> tuple[str, ...]:
    return ("unified", "split") if "--no-kv-unified" in server_flags() else ("unified",)
