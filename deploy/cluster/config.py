"""What the operator chose for the cluster, from the environment: the one place its variables are read.

    TESSERA_CLUSTER_NO_INSTALL=1   never install an engine (apt-get), as `up --no-install`
    TESSERA_CLUSTER_ENGINE=podman  use podman even where a Docker daemon answers
    TESSERA_OFFLINE_WHEELS=1       on Docker, build the images from build/wheels as podman always does
    TESSERA_CLUSTER_KEEP=1         tests/cluster leaves the cluster running when it ends
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

NO_INSTALL = "TESSERA_CLUSTER_NO_INSTALL"
ENGINE = "TESSERA_CLUSTER_ENGINE"
OFFLINE_WHEELS = "TESSERA_OFFLINE_WHEELS"
KEEP = "TESSERA_CLUSTER_KEEP"


@dataclass(frozen=True)
class ClusterSettings:
    no_install: bool
    force_podman: bool
    offline_wheels: bool
    keep: bool

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClusterSettings:
        # Read when asked, not at import: a test or a caller may set a variable after importing the package.
        env = os.environ if env is None else env
        return cls(no_install=bool(env.get(NO_INSTALL)), force_podman=env.get(ENGINE) == "podman",
                   offline_wheels=bool(env.get(OFFLINE_WHEELS)), keep=bool(env.get(KEEP)))


def settings() -> ClusterSettings:
    return ClusterSettings.from_env()
