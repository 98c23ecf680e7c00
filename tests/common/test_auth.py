"""Starting a backend: with neither a backend token nor --insecure-no-auth it refuses in one line (status 2),
as it does for a token file that is missing, short or not the owner's secret alone; `write_token` writes 0600."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.auth import MIN_TOKEN_CHARS, write_token

ROOT = Path(__file__).resolve().parents[2]
VISION = ["-m", "services.vision", "--model", str(ROOT / "models" / "qwen2-vl-random"), "--host", "127.0.0.1",
          "--port", "0", "--redis-url", "redis://127.0.0.1:1/0"]


def start(*argv: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    return subprocess.run([sys.executable, *VISION, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**clean, **env})


def test_a_backend_without_a_token_refuses_to_start():
    done = start()
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no backend token" in lines[0] and "--insecure-no-auth" in lines[0], done.stderr


@pytest.mark.parametrize("content", [None, "short", "two words" + "x" * MIN_TOKEN_CHARS])
def test_a_bad_token_file_is_a_usage_error(tmp_path, content):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    for done in (start("--backend-token-file", str(path)), start(TESSERA_BACKEND_TOKEN_FILE=str(path))):
        assert done.returncode == 2, done.stderr[-2000:]
        assert "backend-token-file" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_token_and_insecure_no_auth_contradict(tmp_path):
    done = start("--insecure-no-auth", "--backend-token-file", str(write_token(tmp_path / "token")))
    assert done.returncode == 2 and "contradict" in done.stderr, done.stderr


def test_write_token_is_private_and_fresh(tmp_path):
    first = write_token(tmp_path / "run" / "token").read_text().strip()
    assert stat.S_IMODE((tmp_path / "run" / "token").stat().st_mode) == 0o600 and len(first) == 64
    assert write_token(tmp_path / "run" / "token").read_text().strip() != first
