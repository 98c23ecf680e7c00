"""When the gateway is ready: every backend role it needs can answer, judged per model for decoder replicas.

- pooling and vision (one address each): SERVING over grpc.health.v1.
- decoder replicas: every served model has at least one SERVING replica. One replica draining,
  loading or dead does not take the gateway out of rotation while another replica serves the same
  model: routing sends that model's calls to the live one (gateway/routing.py). A replica's model is
  learned from discovery (GetModelInfo) and remembered, so a replica that dies later still counts
  toward its model; a replica never discovered counts as a model of its own, since nothing says
  another replica can stand in for it.
"""
from __future__ import annotations

import logging

from .backends import GENERATION, Backend, Catalog

log = logging.getLogger("tessera.gateway.readiness")


class Readiness:
    """Remembers which model each decoder replica serves; one per app (app.state.readiness)."""

    def __init__(self):
        self.models_of: dict[str, frozenset[str]] = {}  # decoder backend label -> generation model names
        self.logged: dict[str, str] = {}   # what was down when last logged (Readiness.down's answer)

    def learn(self, catalog: Catalog) -> None:
        """Record what the catalog's last successful discovery said about each decoder replica."""
        for name, replicas in catalog.by_name.items():
            for model in replicas:
                # An adapter is not a model of its own here: it runs on its base model's replicas.
                if model.kind == GENERATION and model.parent is None:
                    label = model.backend.label
                    self.models_of[label] = self.models_of.get(label, frozenset()) | {name}

    def note(self, down: dict[str, str]) -> None:
        """Log what keeps the gateway from being ready when it changes (anyone but the admin gets only
        ready or not from /ready: the detail, with backend addresses, is here)."""
        if down == self.logged:
            return
        if down:
            log.warning("not ready: %s", "; ".join(f"{what} is {state}" for what, state in down.items()))
        else:
            log.info("ready")
        self.logged = dict(down)

    def down(self, backends: list[Backend], statuses: dict[str, str]) -> dict[str, str]:
        """What keeps the gateway from being ready, {what: state} read as "what is state"; empty when ready.
        statuses: backend label -> its health."""
        down = {b.label: statuses[b.label] for b in backends
                if b.role != "decoder" and statuses[b.label] != "SERVING"}
        groups: dict[str, list[Backend]] = {}
        for backend in (b for b in backends if b.role == "decoder"):
            for name in self.models_of.get(backend.label) or {f"<model of {backend.label}>"}:
                groups.setdefault(name, []).append(backend)
        for name, replicas in groups.items():
            if not any(statuses[b.label] == "SERVING" for b in replicas):
                down[f"model {name}"] = "without a SERVING replica (" + ", ".join(
                    f"{b.label}: {statuses[b.label]}" for b in replicas) + ")"
        return down
