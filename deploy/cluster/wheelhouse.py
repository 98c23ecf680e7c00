"""build/wheels: every wheel the images install, fetched on the host, so that the image build runs offline.

The host's pip downloads (its index, proxy and certificate configuration stay on the host), torch pinned
first; then the image's own pip checks the wheelhouse offline (complete_wheelhouse). deploy/Dockerfile
installs from it with --build-arg WHEELS=local --build-context wheels=build/wheels; on a Docker host it
installs from the indexes unless TESSERA_OFFLINE_WHEELS asks for this path.
"""
from __future__ import annotations

import re
import sys

from .commands import ClusterError, log, run
from .engine import Engine
from .paths import LOGS, ROOT, WHEELS, WORK

TORCH = "torch==2.13.0"  # the same pin as `make install`: a looser one pulls a multi-GB CUDA build
ROUNDS = 20  # dry runs inside the image, each naming what is still missing, before giving up


def wheelhouse_key(python: str) -> str:
    return "\n".join([TORCH, python, (ROOT / "requirements.txt").read_text(), (ROOT / "constraints.txt").read_text()])


def prepare_wheelhouse(engine: Engine | None, python: str, image: str | None) -> None:
    """build/wheels for an offline image build: the host's pip, with the host's index and TLS configuration,
    resolving for the image's Python (binary wheels only, as an offline build cannot compile); then the
    image's own pip checks it (complete_wheelhouse). A stamp keeps a second run to a look."""
    stamp = WORK / "wheels.stamp"  # not inside build/wheels: that folder is a build context
    if stamp.exists() and stamp.read_text() == wheelhouse_key(python):
        log(f"{WHEELS.relative_to(ROOT)}: already there (Python {python})")
        return
    WHEELS.mkdir(parents=True, exist_ok=True)
    # torch first and pinned in the same resolve, so nothing else may pull a CUDA build.
    run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--python-version", python,
         "--only-binary=:all:", TORCH, "-r", "requirements.txt", "-c", "constraints.txt", "-d", str(WHEELS)],
        log_file=LOGS / "wheels.log")
    if engine is not None and image is not None:
        complete_wheelhouse(engine, image)
    stamp.write_text(wheelhouse_key(python))


def complete_wheelhouse(engine: Engine, image: str) -> None:
    """Ask the image's own pip, offline, whether the wheelhouse satisfies everything; fetch what it names.

    The host's pip judges environment markers for the host's interpreter, so a dependency the image's Python
    needs and the host's does not (`async-timeout; python_full_version < "3.11.3"`, from redis) is missing.
    A dry run inside the image names it; the host's pip downloads it; repeat until the dry run passes."""
    mounts = ["-v", f"{WHEELS}:/wheels:ro", "-v", f"{ROOT / 'requirements.txt'}:/req/requirements.txt:ro",
              "-v", f"{ROOT / 'constraints.txt'}:/req/constraints.txt:ro"]
    script = ("python -m venv /tmp/venv && /tmp/venv/bin/pip install -q --disable-pip-version-check --dry-run "
              f"--no-index --find-links /wheels {TORCH} -r /req/requirements.txt -c /req/constraints.txt")
    for _ in range(ROUNDS):
        done = engine("run", "--rm", *mounts, image, "sh", "-c", script, check=False, timeout=600)
        if done.returncode == 0:
            return
        missing = re.findall(r"No matching distribution found for ([^\s;]+)", done.stdout + done.stderr)
        if not missing:
            raise ClusterError(f"the wheelhouse does not satisfy the image's pip:\n{done.stdout}{done.stderr}")
        log(f"the image's Python also needs {missing}: downloading")
        run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--only-binary=:all:",
             *missing, "-c", "constraints.txt", "-d", str(WHEELS)], log_file=LOGS / "wheels.log")
    raise ClusterError(f"the wheelhouse is still incomplete after {ROUNDS} rounds")
