"""`make cluster-up` / `make cluster-down`: deploy/docker-compose.yml in real containers, on this machine.

    python -m deploy.cluster up [--no-install] [--timeout S]   # prepare, build, start, wait healthy, print URLs
    python -m deploy.cluster down                             # remove it all; fail if anything is left
    python -m deploy.cluster status                           # each service's health, by the compose check

The engine is whichever is present: Docker with `docker compose` (a running daemon), else podman with
podman-compose. Where neither is, `up` installs podman when it may (root and apt-get; `--no-install` or
TESSERA_CLUSTER_NO_INSTALL=1 forbids it) and otherwise stops with one line saying why (exit 3).

One module per concern, dependencies pointing down the list:
    cli        the command line: up / down / status, their messages and exit codes
    lifecycle  up, down, status: the phases in order, ports, models, `compose up`
    health     each service's own compose health check, run inside its container
    images     podman's base and Redis images (no registry), one build per compose target
    wheelhouse build/wheels for an offline image build, checked by the image's own pip
    engine     Docker or podman: which one, and what it says about the project's containers
    podman     the host set-up podman needs: the only code that installs packages or writes as root
    compose    deploy/docker-compose.yml, read once into a typed value
    timings    seconds per phase, build/cluster/timings.json
    commands   running a tool, logging, the two errors
    config     every TESSERA_CLUSTER_* / TESSERA_OFFLINE_WHEELS read
    paths      where things lie
Every phase prints its time; build and compose output goes to build/cluster/logs/.
"""
from __future__ import annotations

from .cli import main
from .commands import NOT_AVAILABLE, ClusterError, EngineUnavailable
from .compose import GATEWAY_URL, ComposeFile
from .config import ClusterSettings, settings
from .engine import Engine, engine_if_present, find_engine
from .health import wait_healthy
from .lifecycle import compose_up, down, status, up

__all__ = ["GATEWAY_URL", "NOT_AVAILABLE", "ClusterError", "ClusterSettings", "ComposeFile", "Engine",
           "EngineUnavailable", "compose_up", "down", "engine_if_present", "find_engine", "main", "settings",
           "status", "up", "wait_healthy"]
