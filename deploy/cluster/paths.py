"""Where the cluster's inputs and outputs lie, and the compose project's name."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
PODMAN_OVERRIDE = DEPLOY / "compose.podman.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
IGNOREFILE = DEPLOY / "Dockerfile.dockerignore"
REDIS_CONTAINERFILE = DEPLOY / "redis.Containerfile"
WORK = ROOT / "build" / "cluster"
LOGS = WORK / "logs"  # build and compose output, one file per kind, appended per run
COMPOSE_LOG = LOGS / "compose.log"
TIMINGS = WORK / "timings.json"
# The fleet's secrets (deploy/secrets.py), written on first start and kept; deploy/docker-compose.yml mounts them.
SECRETS = WORK / "secrets"
WHEELS = ROOT / "build" / "wheels"
MODELS = ROOT / "models"
PROJECT = "tessera"  # the compose project: every container, network and volume carries it in its labels
