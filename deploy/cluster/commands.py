"""Running the tools the cluster is made with (compose, podman, pip, apt-get), and the two ways it fails."""
from __future__ import annotations

import subprocess
from pathlib import Path

from .paths import ROOT

NOT_AVAILABLE = 3  # exit status when no engine can be had here


class EngineUnavailable(RuntimeError):
    """No container engine here, and none may be installed; the message is one line saying why."""


class ClusterError(RuntimeError):
    """A step of bringing the cluster up, checking or taking it down failed; the message says which and why."""


def log(msg: str) -> None:
    print(f"[cluster] {msg}", flush=True)


def run(cmd: list[str], *, check: bool = True, capture: bool = False, env: dict[str, str] | None = None,
        cwd: Path = ROOT, timeout: float | None = None, quiet: bool = False,
        log_file: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command. log_file: its output goes there (appended), not to the terminal; a failure quotes its end."""
    if not quiet:
        log("$ " + " ".join(cmd) + (f"  (output: {log_file.relative_to(ROOT)})" if log_file else ""))
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with log_file.open("a") as out:
            out.write(f"\n$ {' '.join(cmd)}\n")
            out.flush()
            done = subprocess.run(cmd, cwd=cwd, env=env, text=True, timeout=timeout, stdout=out,
                                  stderr=subprocess.STDOUT)
        if check and done.returncode != 0:
            tail = "\n".join(log_file.read_text().splitlines()[-40:])
            raise ClusterError(f"{' '.join(cmd[:4])}... exited {done.returncode}; the end of {log_file}:\n{tail}")
        return done
    done = subprocess.run(cmd, cwd=cwd, env=env, text=True, timeout=timeout,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    if check and done.returncode != 0:
        detail = f"\n{done.stdout or ''}{done.stderr or ''}".rstrip() if capture else ""
        raise ClusterError(f"{' '.join(cmd[:4])}... exited {done.returncode}{detail}")
    return done
