"""The images: podman's base and Redis images, made without a registry, and one build per compose target.

No image registry may be reachable, so under podman the base is a Debian bookworm root filesystem made by
mmdebstrap from the host's own apt sources and `podman import`ed (localhost/tessera-python:bookworm), and
Redis is that base plus Debian's redis-server (deploy/redis.Containerfile).
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

from .commands import ClusterError, log, run
from .engine import Engine
from .paths import DEPLOY, DOCKERFILE, IGNOREFILE, LOGS, REDIS_CONTAINERFILE, ROOT, WHEELS, WORK

BASE_IMAGE = "localhost/tessera-python:bookworm"
REDIS_IMAGE = "localhost/tessera-redis:bookworm"
SUITE = "bookworm"  # python3 is 3.11 there, as in python:3.11-slim-bookworm and on the host the wheels come from
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates", "make")


def apt_sources() -> list[str]:
    """The host's apt source files that name the base's suite, found the way apt finds them."""
    done = subprocess.run(["apt-config", "shell", "SL", "Dir::Etc::sourcelist/f", "SP", "Dir::Etc::sourceparts/d"],
                          capture_output=True, text=True)
    values = dict(line.split("=", 1) for line in done.stdout.split() if "=" in line)
    sourcelist = Path(values.get("SL", "'/etc/apt/sources.list'").strip("'"))
    parts = Path(values.get("SP", "'/etc/apt/sources.list.d/'").strip("'"))
    files = [sourcelist] + sorted(p for p in parts.glob("*") if p.suffix in (".list", ".sources"))
    chosen = []
    for path in files:
        try:
            lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
        except OSError:
            continue
        if any(SUITE in line for line in lines):
            chosen.append(str(path))
    if not chosen:
        raise ClusterError(f"no apt source on this host names {SUITE}: cannot build the base image")
    return chosen


def image_exists(engine: Engine, image: str) -> bool:
    return engine("image", "exists", image, check=False).returncode == 0


def build_base_image(engine: Engine) -> None:
    """Debian bookworm with python3, venv and make, from the host's apt sources, imported as BASE_IMAGE."""
    if image_exists(engine, BASE_IMAGE):
        log(f"{BASE_IMAGE}: already there")
        return
    WORK.mkdir(parents=True, exist_ok=True)
    rootfs = WORK / "rootfs.tar"
    rootfs.unlink(missing_ok=True)
    try:
        # Check-Valid-Until off: a snapshot mirror's Release files may carry an expired date.
        run(["mmdebstrap", "--variant=apt", "--include=" + ",".join(BASE_PACKAGES),
             "--aptopt=Acquire::Check-Valid-Until \"false\"", SUITE, str(rootfs), *apt_sources()],
            log_file=LOGS / "base-image.log")
        engine("import", "--change", 'CMD ["/bin/bash"]', str(rootfs), BASE_IMAGE, timeout=600)
    finally:
        rootfs.unlink(missing_ok=True)


def build_redis_image(engine: Engine) -> None:
    if image_exists(engine, REDIS_IMAGE):
        log(f"{REDIS_IMAGE}: already there")
        return
    run([engine.cli, "build", "-f", str(REDIS_CONTAINERFILE), "--build-arg", f"BASE={BASE_IMAGE}",
         "-t", REDIS_IMAGE, str(DEPLOY)], env=engine.env, log_file=LOGS / "build.log")


def image_python(engine: Engine, image: str) -> str:
    """The full Python version inside an image (3.11.2 on bookworm): markers such as
    `python_full_version < "3.11.3"` (redis needs async-timeout there) must be judged for it, not the host."""
    done = engine("run", "--rm", image, "python3", "-c", "import platform; print(platform.python_version())")
    return done.stdout.strip()


def build_images(engine: Engine, offline_wheels: bool) -> None:
    """One build per image the compose file builds, from deploy/Dockerfile at that service's target."""
    args = ["build", "-f", str(DOCKERFILE)]
    if engine.name == "podman":
        # buildah reads no Dockerfile.dockerignore beside the Dockerfile: name it, or .venv and models/ go in.
        args += ["--ignorefile", str(IGNOREFILE), "--build-arg", f"PYTHON_IMAGE={BASE_IMAGE}"]
    if offline_wheels:
        args += ["--build-arg", "WHEELS=local", "--build-context", f"wheels={WHEELS}"]
    for image, target in engine.project.build_targets().items():
        with_cache = time.monotonic()
        run([engine.cli, *args, "--target", target, "-t", image, str(ROOT)], env=engine.env,
            log_file=LOGS / "build.log")
        log(f"{image} (target {target}) built in {time.monotonic() - with_cache:.1f}s")
    # The images these tags replaced, now untagged: only ours (the label), never another project's.
    engine("image", "prune", "-f", "--filter", "label=tessera.project=tessera", check=False, timeout=300)
