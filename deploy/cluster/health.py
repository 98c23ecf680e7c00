"""Whether each service is healthy, by its own compose health check run inside its container.

podman 4.3 runs no health checks by itself and podman-compose skips `condition: service_healthy` on it, so
the harness runs every service's check itself, for every engine.
"""
from __future__ import annotations

import time

from .commands import ClusterError, log
from .engine import Engine

GONE = ("exited", "dead", "absent", "stopped")  # container states from which no check will ever pass


def check_once(engine: Engine, service: str) -> tuple[bool, str]:
    """(passed, the check's last line of output, or the container's state where none runs)."""
    cid = engine.container(service, running=True)
    if cid is None:
        return False, engine.state(service)
    done = engine("exec", cid, *engine.project.services[service].health_check, check=False, timeout=30)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode == 0, lines[-1] if lines else f"exit {done.returncode}"


def wait_healthy(engine: Engine, timeout: float, services: list[str] | None = None) -> dict[str, float]:
    """Poll every service's own health check inside its container until all pass; seconds each took."""
    pending: dict[str, str | None] = dict.fromkeys(services or list(engine.project.services))
    unknown = set(pending) - set(engine.project.services)
    if unknown:
        raise ClusterError(f"no such service in {engine.project.path.name}: {sorted(unknown)}")
    started = time.monotonic()
    took: dict[str, float] = {}
    while pending:
        for name in list(pending):
            ok, seen = check_once(engine, name)
            if ok:
                took[name] = round(time.monotonic() - started, 1)
                log(f"{name}: healthy after {took[name]}s")
                del pending[name]
                continue
            state = engine.state(name)
            if state in GONE:
                raise ClusterError(f"{name} is {state}, not starting; its last lines:\n{engine.logs(name)}")
            pending[name] = seen
        if pending and time.monotonic() - started > timeout:
            detail = "\n".join(f"  {n}: {s}\n{engine.logs(n, 10)}" for n, s in pending.items())
            raise ClusterError(f"not healthy after {timeout:.0f}s:\n{detail}")
        if pending:
            time.sleep(1)
    return took


def report(engine: Engine) -> int:
    """One line per service, healthy or not; 1 if any is not, else 0."""
    bad = 0
    for name in engine.project.services:
        ok, seen = check_once(engine, name)
        bad += not ok
        print(f"  {name:<10} {'healthy' if ok else 'NOT healthy'}  ({engine.state(name)}; {seen})")
    return 1 if bad else 0
