"""What the deploy tests compare: the launcher's TOPOLOGY rendered for containers, argv parsing, the protos'
gRPC service names, and the compose and Kubernetes files loaded as data.

The launcher is the single source of the fleet's shape (deploy/launcher.py TOPOLOGY); the compose file and
the manifests are written by hand for people to read, and these helpers let the tests hold them to it.
Importing deploy.launcher has no side effects (it only defines the table and functions).
"""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from deploy import launcher
from gateway import config as gateway_config
from services.decoder.server import config as decoder_config
from services.pooling import config as pooling_config
from services.vision import config as vision_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"

# Where a containerised process finds what the launcher passes as placeholders.
CONTAINER_VALUES = {"python": "python", "host": "0.0.0.0", "models": "/models", "run": "/data",
                    "secrets": "/run/secrets"}
# "{host}:{NAME_port}" is an address a process dials: in a container network that is the service NAME.
_DIAL = re.compile(r"\{host\}:\{([\w-]+)_port\}")  # row names may hold a hyphen (decoder-vl)
_PORT_REF = re.compile(r"\{([\w-]+)_port\}")

# Compose services the launcher table does not have a row for YET, with the gateway flag that reaches
# each. Once a row lands, the agreement test fails until the name is removed here, so the full comparison
# applies to it (the decoder's and vision's rows went through exactly that). Empty: every row has landed.
AWAITING_LAUNCHER_ROW: dict[str, str] = {}


def rows() -> dict[str, launcher.Service]:
    return {row.name: row for row in launcher.TOPOLOGY}


def table_ports() -> dict[str, int]:
    return {row.name: row.port for row in launcher.TOPOLOGY}


def container_argv(row: launcher.Service, ports: dict[str, int] | None = None) -> list[str]:
    """The row's argv as a container runs it: binds 0.0.0.0, dials peers by service name, models at /models."""
    ports = table_ports() if ports is None else ports
    values = {**CONTAINER_VALUES, "port": ports[row.name], **{f"{n}_port": p for n, p in ports.items()}}
    return [_DIAL.sub(lambda m: f"{m[1]}:{{{m[1]}_port}}", part).format(**values) for part in row.argv]


def container_value(template: str) -> str:
    """A launcher value with placeholders ({models}/...) as a container sees it."""
    return template.format(**CONTAINER_VALUES)


def referenced_services(row: launcher.Service) -> set[str]:
    """The other rows this row's argv points at ({NAME_port}): the ones it must start after."""
    return {m for part in row.argv for m in _PORT_REF.findall(part)} - {row.name}


def split_argv(argv: list[str]) -> tuple[list[str], list[tuple[str, str | None]]]:
    """(program words before the first --flag, sorted (flag, value) pairs).

    Sorted because argparse does not care about flag order, and two engineers may order a row differently;
    repeated flags (--decoder twice) stay as two pairs. A flag followed by another flag has no value.
    """
    first = next((i for i, a in enumerate(argv) if a.startswith("--")), len(argv))
    pairs, rest = [], argv[first:]
    i = 0
    while i < len(rest):
        if not rest[i].startswith("--"):
            raise ValueError(f"stray argument {rest[i]!r} in {argv}")
        has_value = i + 1 < len(rest) and not rest[i + 1].startswith("--")
        pairs.append((rest[i], rest[i + 1] if has_value else None))
        i += 2 if has_value else 1
    return argv[:first], sorted(pairs, key=lambda p: (p[0], p[1] or ""))


def module_of(argv: list[str]) -> str:
    """`python -m MOD ...` -> MOD; anything else -> its program name (redis-server)."""
    return argv[argv.index("-m") + 1] if "-m" in argv[:3] else argv[0]


def grpc_service_names() -> set[str]:
    """Every `package.Service` the protos declare: what a gRPC health check may name."""
    names = set()
    for proto in (ROOT / "protos").rglob("*.proto"):
        text = proto.read_text()
        package = re.search(r"^package\s+([\w.]+);", text, re.M)
        names |= {f"{package[1]}.{svc}" for svc in re.findall(r"^service\s+(\w+)", text, re.M)} if package else set()
    return names


def redis_ping(port: int) -> list[str]:
    """The argv that asks Redis for PONG with the password (compose health check, k8s exec probe)."""
    return ["sh", "-c", f"redis-cli -p {port} --askpass ping < /run/secrets/redis_password | grep -qx PONG"]


def expected_healthcheck(row: launcher.Service, port: int) -> list[str]:
    """The container health check that asks what launcher.healthy asks."""
    kind, _, arg = row.health.partition(":")
    if kind == "redis":  # authenticated, the password from the secret on stdin: a NOAUTH reply must fail it
        return ["CMD", *redis_ping(port)]
    probe = ["CMD", "python", "-m", "services.common.healthcheck"]
    if kind == "grpc":
        return [*probe, f"127.0.0.1:{port}", arg]
    if kind == "http":
        return [*probe, f"http://127.0.0.1:{port}{arg}"]
    raise ValueError(f"unknown health kind {row.health!r}")


# Env var prefix per module (each config module's ENV_PREFIX): a launcher env flag such as
# --reranker-model becomes TESSERA_POOLING_RERANKER_MODEL inside the pooling container.
ENV_PREFIX = {"gateway": gateway_config.ENV_PREFIX, "services.decoder": decoder_config.ENV_PREFIX,
              "services.vision": vision_config.ENV_PREFIX, "services.pooling": pooling_config.ENV_PREFIX}


def env_var_for(row: launcher.Service, flag: str) -> str:
    prefix = ENV_PREFIX[module_of(list(row.argv))]
    return prefix + flag.removeprefix("--").replace("-", "_").upper()


def env_variables() -> dict[str, set[str]]:
    """module -> every variable its config reads (PREFIX + FIELD, or a field's own env name)."""
    import dataclasses

    from services.decoder.server.config import DecoderConfig, DecoderServerConfig
    from services.pooling.config import PoolingConfig, PoolingServerConfig
    from services.vision.config import VisionConfig, VisionServerConfig

    classes = {"gateway": (gateway_config.GatewayConfig,), "services.decoder": (DecoderServerConfig, DecoderConfig),
               "services.vision": (VisionServerConfig, VisionConfig),
               "services.pooling": (PoolingServerConfig, PoolingConfig)}
    return {module: {f.metadata.get("env") or ENV_PREFIX[module] + f.name.upper()
                     for cls in group for f in dataclasses.fields(cls)} for module, group in classes.items()}


def load_compose(path: Path = COMPOSE) -> dict:
    return yaml.safe_load(path.read_text())


def load_k8s() -> list[dict]:
    """Every object in deploy/k8s/*.yaml except kustomization.yaml (a kustomize file, not an API object)."""
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [dict(doc, _file=path.name) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs
