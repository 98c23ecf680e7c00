"""The command line, `python -m deploy.cluster up | down | status`: what each prints and the exit status.

    0  done (up: healthy; down: nothing left; status: every service healthy)
    1  failed (one line `cluster: FAILED: ...` on stderr, then the detail), or down left something behind,
       or status found a service not healthy
    3  NOT_AVAILABLE: no container engine here and none may be installed (`cluster: NOT RUN: ...`)
"""
from __future__ import annotations

import argparse
import sys

from .commands import NOT_AVAILABLE, ClusterError, EngineUnavailable
from .lifecycle import down, status, up

DESCRIPTION = "`make cluster-up` / `make cluster-down`: deploy/docker-compose.yml in real containers, on this machine."


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deploy.cluster", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="prepare, build and start the compose cluster; wait until healthy")
    p_up.add_argument("--no-install", action="store_true", help="never install an engine (apt-get)")
    p_up.add_argument("--timeout", type=float, default=600, help="seconds to wait for healthy (default 600)")
    sub.add_parser("down", help="remove the cluster's containers, pod, network and volumes")
    sub.add_parser("status", help="each service's compose health check, run in its container")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.cmd == "up":
            up(install=not args.no_install, timeout=args.timeout)
            return 0
        if args.cmd == "down":
            return 1 if down() else 0
        return status()
    except EngineUnavailable as exc:
        print(f"cluster: NOT RUN: {exc}", flush=True)
        return NOT_AVAILABLE
    except ClusterError as exc:
        print(f"cluster: FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
