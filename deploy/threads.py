"""Torch threads and OpenMP waiting for model services that share one machine (docs/operation.md, thread settings).

Each model service (decoder, decoder-vl, pooling, vision) sizes its own torch thread team once at start
(`--threads`, services/common/process.py; 0 keeps torch's default, one thread per visible CPU) and keeps
its steady compute on one thread (services/common/compute.py). What it cannot see is its neighbours: four
services each taking every core, and each team's idle workers spinning in libgomp between ops (torch's
wheels bundle GNU OpenMP, which honours OMP_WAIT_POLICY and GOMP_SPINCOUNT, read once when the library
loads), spend on spinning the cores the others wait for. Measured on a Zen 4 with `make bench-load`: the
fleet did ~0.68 of the machine's GEMM probe as useful work, ~0.8 with OMP_WAIT_POLICY=PASSIVE.

So the shapes that put several model services on one machine (`make up`, bench/load.py, the compose file,
the Kubernetes manifests) give each of them
- `threads`: the machine's CPUs split by the services' shares (`Service.compute_share` in the launcher's
  table, which is the Kubernetes cpu request), largest remainder first, at least one each;
- OMP_WAIT_POLICY=PASSIVE: an idle worker sleeps at once instead of spinning for a neighbour's core.

A service started alone (`python -m services.decoder ...`) gets neither: every core and libgomp's own
active wait, which served batch-1 decode best. What the operator set wins: a TESSERA_<SERVICE>_THREADS
variable keeps that service's count, and an OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment keeps
the wait as it is.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

# The libgomp variables that say how idle workers wait: one set by the operator is left alone.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SHARED_WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}


@dataclass(frozen=True)
class ThreadSettings:
    """What one model service starts with: `threads` for --threads (None: its own default, or the
    operator's TESSERA_<SERVICE>_THREADS), and variables added to its environment."""

    threads: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        return [] if self.threads is None else ["--threads", str(self.threads)]


def machine_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as a container's cpuset limits it)."""
    return len(os.sched_getaffinity(0))


def split(cpus: int, shares: Mapping[str, float]) -> dict[str, int]:
    """{service: share} -> {service: threads}: cpus apportioned by share, largest remainder first (ties in
    the mapping's order), at least 1 each; so the threads add up to max(cpus, number of services)."""
    if cpus < 1 or not shares or min(shares.values()) <= 0:
        raise ValueError(f"need cpus >= 1 and positive shares, got cpus={cpus}, shares={dict(shares)}")
    total = sum(shares.values())
    quota = {name: cpus * share / total for name, share in shares.items()}
    threads = {name: max(1, int(q)) for name, q in quota.items()}
    order = sorted(shares, key=lambda name: -(quota[name] - int(quota[name])))
    for name in order[:max(0, cpus - sum(threads.values()))]:
        threads[name] += 1
    return threads


def fleet(shares: Mapping[str, float], cpus: int, environ: Mapping[str, str] = os.environ,
          thread_variables: Mapping[str, str] | None = None) -> dict[str, ThreadSettings]:
    """The settings of each model service of a fleet on one machine of `cpus` CPUs.

    shares: {service: its share of the machine}; thread_variables: {service: its TESSERA_<SERVICE>_THREADS
    name}: set in environ, that service keeps the operator's count. One service alone keeps its defaults."""
    if len(shares) < 2:
        return {name: ThreadSettings() for name in shares}
    env = {} if any(environ.get(name) for name in WAIT_VARIABLES) else dict(SHARED_WAIT)
    variables = thread_variables or {}
    return {name: ThreadSettings(None if environ.get(variables.get(name, "")) else threads, env)
            for name, threads in split(cpus, shares).items()}


def describe(settings: Mapping[str, ThreadSettings], cpus: int) -> str:
    """One line for the log: "threads on 2 CPUs: decoder 1, pooling 1; OMP_WAIT_POLICY=PASSIVE"."""
    counts = ", ".join(f"{name} {s.threads if s.threads is not None else 'its own'}" for name, s in settings.items())
    env = {k: v for s in settings.values() for k, v in s.env.items()}
    wait = " ".join(f"{k}={v}" for k, v in env.items()) or "OpenMP wait as the environment says"
    return f"threads on {cpus} CPUs: {counts}; {wait}"
