"""bench/lora_kernels.py: its CPU-side logic runs (--dry-run) and it refuses clearly without CUDA."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "lora_kernels.py"


def _run(*args, **env_overrides):
    env = dict(os.environ, **env_overrides)
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_dry_run_checks_kernels_and_prints_the_ratio_last():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    checks = [line for line in lines if "max|err|=" in line]
    assert len(checks) == 8 and all(line.rstrip().endswith("ok") for line in checks), proc.stdout
    rows = [line for line in lines if line.startswith(("decode ", "prefill "))]
    assert len(rows) == 2 and all(line.rstrip().endswith("x") for line in rows), proc.stdout
    # Interpreter timings are meaningless; only the shape of the last line is checked.
    assert re.fullmatch(r"geometric-mean speedup \(.*\): [0-9.e+-]+x", lines[-1]), lines[-1]


def test_without_cuda_it_exits_with_a_clear_message():
    proc = _run(CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stdout and "--dry-run" in proc.stdout
