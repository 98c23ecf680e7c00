"""deploy/docker-compose.yml as one typed value, read once: what `up` builds, starts, checks and prints.

Only the main file is read. podman's override (deploy/compose.podman.yml) changes the Redis image and drops
`healthcheck.start_interval`, neither of which the harness consults; compose itself lays it over the main file.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from .commands import ClusterError
from .paths import COMPOSE

# The gateway's published port as the compose file maps it ("8000:8000"); tests/deploy holds the two equal.
GATEWAY_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class Port:
    """One `ports:` entry, "[HOST:]HOST_PORT:CONTAINER_PORT", as published on the host."""

    host: str | None  # None: every address (Docker's default when the entry names none)
    host_port: int

    @classmethod
    def parse(cls, service: str, entry: object) -> Port:
        if not isinstance(entry, str) or entry.count(":") not in (1, 2):
            raise ClusterError(f"{service}: port {entry!r} is not \"[HOST:]HOST_PORT:CONTAINER_PORT\"")
        host, _, host_port = entry.rsplit(":", 1)[0].rpartition(":")
        try:
            return cls(host or None, int(host_port))
        except ValueError:
            raise ClusterError(f"{service}: port {entry!r} has no numeric host port") from None

    @property
    def bind_host(self) -> str:
        return self.host or "0.0.0.0"

    @property
    def dial_host(self) -> str:
        return self.host or "127.0.0.1"


@dataclass(frozen=True)
class Service:
    name: str
    image: str
    build_target: str | None          # the Dockerfile target, for the services this project builds
    health_check: tuple[str, ...]     # the argv of its compose health check (CMD form)
    ports: tuple[Port, ...]

    @classmethod
    def parse(cls, name: str, svc: dict) -> Service:
        if not isinstance(svc, dict) or not isinstance(svc.get("image"), str):
            raise ClusterError(f"{name}: no image (the harness builds or starts every service by its image)")
        test = (svc.get("healthcheck") or {}).get("test")
        if not test:
            raise ClusterError(f"{name}: no health check (the harness waits for every service by its own)")
        if test[0] != "CMD":
            raise ClusterError(f"{name}: health check {test[0]} is not CMD")
        build = svc.get("build")
        return cls(name=name, image=svc["image"], build_target=build["target"] if build else None,
                   health_check=tuple(test[1:]), ports=tuple(Port.parse(name, p) for p in svc.get("ports", [])))

    def urls(self) -> list[str]:
        out = []
        for port in self.ports:
            where = f"{port.dial_host}:{port.host_port}"
            if self.name == "gateway":
                out.append(f"  {self.name:<10} http://{where} (OpenAI base_url http://{where}/v1)")
            elif self.name == "redis":
                out.append(f"  {self.name:<10} redis://{where}/0")
            else:
                out.append(f"  {self.name:<10} {where} (gRPC)")
        return out


@dataclass(frozen=True)
class ComposeFile:
    path: Path
    services: dict[str, Service]  # in the file's order

    @classmethod
    def load(cls, path: Path = COMPOSE) -> ComposeFile:
        try:
            services = yaml.safe_load(path.read_text())["services"]
        except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
            first = (str(exc).splitlines() or [""])[0]
            raise ClusterError(f"{path}: not a compose file with services ({exc.__class__.__name__}: {first})") \
                from exc
        return cls(path, {name: Service.parse(name, svc) for name, svc in services.items()})

    def build_targets(self) -> dict[str, str]:
        """image -> Dockerfile target, for every service that is built (two services may share an image)."""
        return {s.image: s.build_target for s in self.services.values() if s.build_target is not None}

    def health_checks(self) -> dict[str, tuple[str, ...]]:
        return {name: s.health_check for name, s in self.services.items()}

    def published_ports(self) -> list[tuple[str, Port]]:
        return [(name, port) for name, s in self.services.items() for port in s.ports]

    def urls(self) -> list[str]:
        return [line for s in self.services.values() for line in s.urls()]
