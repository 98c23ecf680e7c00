"""The container engine: which one this machine has (Docker with its compose plugin, else podman with
podman-compose), and the commands that ask it about the project's containers."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

from . import podman
from .commands import run
from .compose import ComposeFile
from .config import ClusterSettings, settings
from .paths import COMPOSE, COMPOSE_LOG, PODMAN_OVERRIDE, PROJECT


@dataclass
class Engine:
    """A container CLI, the compose command that drives the project with it, and the compose file it runs."""

    name: str                      # "docker" | "podman"
    compose_cmd: list[str]         # ... -f FILES; append a subcommand
    project: ComposeFile = field(default_factory=ComposeFile.load)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))

    @property
    def cli(self) -> str:
        return self.name

    def compose(self, *args: str, check: bool = True, timeout: float | None = None):
        """A compose subcommand; its output goes to build/cluster/logs/compose.log (podman 4.3 prints a systemd
        error per health check it cannot schedule: noise, since the harness runs the checks itself)."""
        return run([*self.compose_cmd, *args], check=check, env=self.env, timeout=timeout, log_file=COMPOSE_LOG)

    def __call__(self, *args: str, check: bool = True, capture: bool = True, quiet: bool = True,
                 timeout: float | None = 120):
        return run([self.cli, *args], check=check, capture=capture, env=self.env, timeout=timeout, quiet=quiet)

    @property
    def project_label(self) -> str:
        return f"com.docker.compose.project={PROJECT}"

    def container(self, service: str, *, running: bool = False) -> str | None:
        """The id of the service's container (the newest), by the labels both compose tools set."""
        args = ["ps", "-q"] + ([] if running else ["-a"])
        done = self(*args, "--filter", f"label={self.project_label}",
                    "--filter", f"label=com.docker.compose.service={service}")
        ids = done.stdout.split()
        return ids[0] if ids else None

    def state(self, service: str) -> str:
        cid = self.container(service)
        if cid is None:
            return "absent"
        return self("inspect", "--format", "{{.State.Status}}", cid, check=False).stdout.strip() or "absent"

    def logs(self, service: str, lines: int = 30) -> str:
        cid = self.container(service)
        if cid is None:
            return "(no container)"
        done = self("logs", "--tail", str(lines), cid, check=False)
        return (done.stdout + done.stderr).strip()

    def leftovers(self) -> list[str]:
        """Every container, pod, network and volume of the project still there (empty after `down`)."""
        found = []
        label = ["--filter", f"label={self.project_label}"]
        found += [f"container {c}" for c in self("ps", "-a", "-q", *label).stdout.split()]
        if self.name == "podman":
            found += [f"container {c}" for c in self("ps", "-a", "-q", "--filter",
                                                     f"label=io.podman.compose.project={PROJECT}").stdout.split()
                      if f"container {c}" not in found]
            pods = self("pod", "ps", "--format", "{{.Name}}").stdout.split()
            found += [f"pod {p}" for p in pods if p in (f"pod_{PROJECT}", PROJECT)]
        networks = self("network", "ls", "--format", "{{.Name}}").stdout.split()
        found += [f"network {n}" for n in networks if n.startswith((f"{PROJECT}_", f"{PROJECT}-"))]
        volumes = set(self("volume", "ls", "-q", *label).stdout.split())
        prefixes = (f"{PROJECT}_", f"{PROJECT}-")
        volumes |= {v for v in self("volume", "ls", "-q").stdout.split() if v.startswith(prefixes)}
        found += [f"volume {v}" for v in sorted(volumes)]
        return found


def docker_engine() -> Engine | None:
    """Docker, when its daemon answers and the compose plugin is there (a client alone is not an engine)."""
    if shutil.which("docker") is None:
        return None
    for probe in (["docker", "info", "--format", "{{.ServerVersion}}"], ["docker", "compose", "version"]):
        try:
            if subprocess.run(probe, capture_output=True, timeout=20).returncode != 0:
                return None
        except (OSError, subprocess.TimeoutExpired):
            return None
    return Engine("docker", ["docker", "compose", "-p", PROJECT, "-f", str(COMPOSE)])


def podman_engine(compose: list[str]) -> Engine:
    # -p: the project name the labels carry; the override holds podman's choices (deploy/compose.podman.yml).
    return Engine("podman", [*compose, "-p", PROJECT, "-f", str(COMPOSE), "-f", str(PODMAN_OVERRIDE)])


def find_engine(install: bool = True, chosen: ClusterSettings | None = None) -> Engine:
    """Docker with compose when a daemon runs, else podman (installed and configured where allowed)."""
    chosen = chosen or settings()
    if not chosen.force_podman:
        engine = docker_engine()
        if engine is not None:
            return engine
    return podman_engine(podman.prepare_host(install, chosen))


def engine_if_present(chosen: ClusterSettings | None = None) -> Engine | None:
    """The engine, without installing or configuring anything (for down and status)."""
    chosen = chosen or settings()
    engine = docker_engine() if not chosen.force_podman else None
    if engine is None and shutil.which("podman") and podman.COMPOSE_EXE.exists():
        engine = podman_engine([str(podman.COMPOSE_EXE)])
    return engine
