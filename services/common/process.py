"""The one start-up of the gRPC services (decoder, vision, pooling): `python -m services.X` runs `main`.

Each service supplies a `Service`: its command name, its config dataclass and env prefix, and `start`,
which binds its Server (health NOT_SERVING), loads its models and reports SERVING (Server.ready). The
rest happens here, in the same order for all three:

1. flags > TESSERA_<SERVICE>_* variables > defaults (services/common/config.py), logged once;
2. logging at --log-level;
3. malloc set to keep freed pages (services/common/allocator.py), before any model allocates;
4. torch's intra-op threads (--threads), before the loop's thread is made serial, which it would undo;
5. the event loop under compute.serially (services/common/compute.py);
6. start, then serve until SIGTERM/SIGINT (Server.serve_until_signal: NOT_SERVING, drain, stop), then
   release what the service holds (Started.close).

Before all of that, the service's `check` reads the model folders its flags name, without loading a weight:
a folder it cannot serve (no such folder, a missing file, an unknown model_type or RoPE type...) is a usage
error, like a bad flag value: one line on stderr naming the missing piece and the config key, status 2, and
nothing else printed. So is a process with neither a backend token (--backend-token-file) nor
--insecure-no-auth (services/common/auth.py). What fails once it runs (a port it cannot bind, a dtype the
device lacks, weights that do not match their config) ends the process with one logged line and status 1.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import allocator, compute, logs
from . import config as config_mod
from .auth import TOKEN_FILE_ENV
from .errors import TesseraError
from .plan import Pins
from .server import ServerConfig, Started

log = logging.getLogger("tessera.process")


@dataclass(frozen=True)
class Service:
    """What a gRPC service hands the shared start-up."""

    prog: str                      # "python -m services.pooling"
    description: str               # --help's first paragraph
    env_prefix: str                # its config module's ENV_PREFIX, e.g. "TESSERA_POOLING_"
    server_config: type[ServerConfig]
    config: type                   # the service's own frozen options dataclass
    start: Callable[[Any, Any], Awaitable[Started]]   # (server_cfg, cfg) -> Started, once SERVING
    # cfg -> None: reads the model folders cfg names and raises (ValueError, OSError, TesseraError, KeyError
    # for a config key that is not there) what the service cannot serve, before anything starts.
    check: Callable[[Any], None] | None = None


def load_config(service: Service, argv=None, environ=None) -> tuple[ServerConfig, Any]:
    """(server config, service config) from argv and the environment; a bad value exits 2 naming it."""
    return config_mod.load((service.server_config, service.config), argv, prog=service.prog,
                           description=service.description, env_prefix=service.env_prefix, environ=environ,
                           former_prefix=config_mod.FORMER_PREFIX)


async def serve(service: Service, server_cfg: ServerConfig, cfg) -> None:
    """Start the service, serve until a signal, then release what it holds."""
    started = await service.start(server_cfg, cfg)
    try:
        await started.server.serve_until_signal()
    finally:
        await started.close()


def main(service: Service, argv=None) -> int:
    """The whole life of a service process; returns its exit status."""
    server_cfg, cfg = load_config(service, argv)
    refusal = refused(service, cfg) or unauthenticated(server_cfg)
    if refusal is not None:
        print(f"{service.prog}: cannot serve: {refusal}", file=sys.stderr)
        return 2
    logs.setup(server_cfg.log_level)
    config_mod.log_config(server_cfg, cfg)
    allocator.keep_freed_memory(Pins.parse(getattr(cfg, "fast_paths", "")).get("malloc"))
    if server_cfg.threads:
        torch.set_num_threads(server_cfg.threads)
    try:
        asyncio.run(compute.serially(serve(service, server_cfg, cfg)))
    except (ValueError, OSError, TesseraError) as exc:
        # A folder the service cannot serve faithfully (or a dtype this device lacks), or a port it cannot
        # bind: say why, exit non-zero.
        log.error("cannot start: %s", exc)
        return 1
    return 0


def unauthenticated(server_cfg: ServerConfig) -> str | None:
    """Why a process may not serve open to its network: no backend token and no explicit opt-out."""
    if server_cfg.backend_token_file is None and not server_cfg.insecure_no_auth:
        return (f"no backend token: set --backend-token-file FILE (env {TOKEN_FILE_ENV}), or pass"
                " --insecure-no-auth to let anyone who reaches the port call every RPC")
    return None


def refused(service: Service, cfg) -> str | None:
    """Why the service cannot serve the folders cfg names, in one line; None when its check passes."""
    if service.check is None:
        return None
    try:
        service.check(cfg)
    except KeyError as exc:
        return f"a config file has no {exc.args[0]!r}"
    except (ValueError, OSError, TesseraError) as exc:
        return " ".join(str(exc).split()) or type(exc).__name__
    return None
