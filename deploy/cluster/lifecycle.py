"""`up`, `down` and `status`: the phases in order, each timed, and what must hold between them."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time

from deploy import secrets as deploy_secrets

from . import health, images, wheelhouse
from .commands import NOT_AVAILABLE, ClusterError, log
from .compose import ComposeFile
from .config import settings
from .engine import Engine, engine_if_present, find_engine
from .paths import COMPOSE_LOG, MODELS, PROJECT, SECRETS
from .timings import Timings


def check_models() -> None:
    """The containers' user (uid 10001) must be able to read every model folder (`make models` writes them so)."""
    if not MODELS.is_dir():
        raise ClusterError("models/ is missing: run `make models`")
    for path in [MODELS, *MODELS.rglob("*")]:
        mode = path.stat().st_mode
        need = 0o005 if path.is_dir() else 0o004
        if mode & need != need:
            raise ClusterError(f"{path} is mode {mode & 0o777:o}: the containers' user cannot read it; "
                               "run `make models` (it repairs the modes)")


def busy_ports(project: ComposeFile) -> list[str]:
    busy = []
    for name, port in project.published_ports():
        with socket.socket() as s:
            try:
                s.bind((port.bind_host, port.host_port))
            except OSError:
                busy.append(f"{name} {port.bind_host}:{port.host_port}")
    return busy


def wait_ports_free(project: ComposeFile, timeout: float = 60) -> None:
    """The published ports must be free on the host. 50051-50054 lie in Linux's ephemeral range, so another
    program's connection or test server may hold one for a moment: wait for it, then say who holds it."""
    deadline = time.monotonic() + timeout
    while busy := busy_ports(project):
        if time.monotonic() > deadline:
            holders = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout if shutil.which("ss") \
                else ""
            raise ClusterError(f"host ports in use: {busy}; free them (make down stops `make up`)\n{holders}")
        time.sleep(1)


def compose_up(engine: Engine, *services: str, attempts: int = 4) -> None:
    """`compose up -d`, again while a port was taken between the check and the bind (see wait_ports_free)."""
    for attempt in range(attempts):
        ours = engine("ps", "-a", "-q", "--filter", f"label={engine.project_label}").stdout.split()
        if not services and not ours:  # our own containers hold the ports once they run
            wait_ports_free(engine.project)
        start = COMPOSE_LOG.stat().st_size if COMPOSE_LOG.exists() else 0
        done = engine.compose("up", "-d", "--no-build", *services, check=False)
        if done.returncode == 0:
            return
        with COMPOSE_LOG.open() as f:
            f.seek(start)
            output = f.read()
        if "address already in use" not in output or attempt == attempts - 1:
            raise ClusterError(f"compose up exited {done.returncode}:\n{output[-3000:]}")
        log("a published port was taken meanwhile: compose up again")
        time.sleep(3)


def up(install: bool = True, timeout: float = 600) -> Engine:
    """Engine set-up, podman's base images, the wheelhouse, the images, compose up, then wait until every
    service is healthy; prints the URLs and saves the phase times."""
    timings = Timings()
    chosen = settings()
    with timings("engine setup"):
        engine = find_engine(install, chosen)
    log(f"engine: {engine.name} ({' '.join(engine.compose_cmd[:1])})")
    check_models()
    offline = engine.name == "podman" or chosen.offline_wheels
    if engine.name == "podman":
        with timings("base image"):
            images.build_base_image(engine)
        with timings("redis image"):
            images.build_redis_image(engine)
    if offline:
        with timings("wheelhouse download"):
            if engine.name == "podman":
                python = images.image_python(engine, images.BASE_IMAGE)
                wheelhouse.prepare_wheelhouse(engine, python, images.BASE_IMAGE)
            else:  # Docker, told to build offline (TESSERA_OFFLINE_WHEELS): the image is python:3.11-slim
                wheelhouse.prepare_wheelhouse(None, "3.11", None)
    with timings("image build"):
        images.build_images(engine, offline)
    # The containers' users read them through the secret mounts; the 0700 folder guards them on the host.
    log(f"backend token and Redis password: {deploy_secrets.ensure(SECRETS, fresh=False, mode=0o644)}")
    started = time.monotonic()
    with timings("compose up"):
        compose_up(engine)
    with timings("start to healthy"):
        took = health.wait_healthy(engine, timeout)
    timings.phases["healthy after start, per service"] = took
    timings.phases["start to healthy (from compose up)"] = round(time.monotonic() - started, 1)
    timings.save(engine.name)
    log("the cluster is up:\n" + "\n".join(engine.project.urls()))
    log(f"stop it with `make cluster-down`; engine {engine.name}, project {PROJECT}")
    return engine


# What removes each kind of leftover a compose tool did not know of.
REMOVE = {"container": ["rm", "-f", "-v"], "pod": ["pod", "rm", "-f"], "network": ["network", "rm"],
          "volume": ["volume", "rm", "-f"]}


def down(engine: Engine | None = None) -> list[str]:
    """Stop and remove every container, pod, network and volume of the project; returns what is left."""
    engine = engine or engine_if_present()
    if engine is None:
        log("no container engine here: nothing to take down")
        return []
    started = time.monotonic()
    engine.compose("down", "-v", "-t", "45", check=False)
    # What a compose tool did not know of (a container made by hand, a crash mid-up): by label, then name.
    for item in engine.leftovers():
        kind, name = item.split(" ", 1)
        engine(*REMOVE[kind], name, check=False)
    left = engine.leftovers()
    log(f"== cluster down: {time.monotonic() - started:.1f}s; "
        + ("nothing left" if not left else "LEFT BEHIND: " + ", ".join(left)))
    return left


def status(engine: Engine | None = None) -> int:
    """Each service's health, one line each: 0 all healthy, 1 not, NOT_AVAILABLE without an engine."""
    engine = engine or engine_if_present()
    if engine is None:
        log("no container engine here")
        return NOT_AVAILABLE
    return health.report(engine)
