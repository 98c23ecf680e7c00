"""The aio gRPC server every service runs (services/common/process.py starts the process around it).

- grpc.health.v1 on every server, open to anyone (probes); server reflection only with --reflection;
- with --backend-token-file, every other call must carry that token (services/common/auth.py), reflection
  included; services/common/process.py refuses to start a service with neither a token nor --insecure-no-auth;
- NOT_SERVING until the service calls `ready()` (after its models load), which also freezes what
  start-up allocated out of the garbage collector's sight;
- the Prometheus /metrics endpoint of the service's registry on --metrics-port, bound to --host;
- max message size from config;
- optional TLS (--tls-cert/--tls-key, mutual with --tls-client-ca; services/common/tls.py);
- SIGTERM/SIGINT: report NOT_SERVING, refuse new calls, give in-flight calls
  `drain_seconds` to finish, then return from `serve_until_signal`.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import REGISTRY, CollectorRegistry

from . import metrics
from .auth import TOKEN_FILE_ENV, TokenInterceptor, read_token
from .config import option
from .tls import check_server_files, server_credentials

log = logging.getLogger("tessera.server")


@dataclass(frozen=True)
class ServerConfig:
    """process and gRPC server options"""

    host: str = option("0.0.0.0", "address to bind")
    port: int = option(0, "port to bind; 0 picks a free one")
    max_message_mb: int = option(64, "largest gRPC message accepted or sent, in MiB")
    drain_seconds: float = option(30.0, "on SIGTERM, how long in-flight calls may take to finish")
    metrics_port: int = option(0, "Prometheus /metrics HTTP port, bound to --host; 0 disables it")
    log_level: str = option("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    threads: int = option(0, "torch intra-op threads; 0 keeps torch's default (all cores)")
    tls_cert: str | None = option(None, "PEM certificate chain: serve gRPC over TLS (with --tls-key)",
                                  metavar="FILE")
    tls_key: str | None = option(None, "PEM private key of --tls-cert", metavar="FILE")
    tls_client_ca: str | None = option(None, "PEM CA: require client certificates signed by it (mutual TLS)",
                                       metavar="FILE")
    backend_token_file: str | None = option(None, "file holding the fleet's backend token: every call but"
                                                  " grpc.health.v1 must carry 'authorization: Bearer <token>'",
                                            env=TOKEN_FILE_ENV, metavar="FILE")
    insecure_no_auth: bool = option(False, "serve without a backend token: anyone who reaches the port may call"
                                           " every RPC (a process refuses to start with neither this nor"
                                           " --backend-token-file)", env="TESSERA_INSECURE_NO_AUTH")
    reflection: bool = option(False, "answer gRPC server reflection (behind the backend token when there is one)")

    def __post_init__(self):
        check_server_files(self.tls_cert, self.tls_key, self.tls_client_ca)
        if self.backend_token_file is not None:
            if self.insecure_no_auth:
                raise ValueError("backend_token_file and insecure_no_auth contradict each other: give one")
            read_token(self.backend_token_file)
        if not 0 <= self.port < 65536 or not 0 <= self.metrics_port < 65536:
            raise ValueError("port and metrics_port must be in 0..65535")
        if self.max_message_mb < 1:
            raise ValueError("max_message_mb must be at least 1")
        if self.drain_seconds < 0:
            raise ValueError("drain_seconds must be >= 0")
        if self.threads < 0:
            raise ValueError("threads must be >= 0")


class Server:
    """One aio gRPC server with health (and reflection with cfg.reflection), behind the backend token.

    add_servicers(server) registers the service's servicers; service_names are
    the full names (e.g. "tessera.pooling.v1.PoolingService") for health and
    reflection; registry is the service's Prometheus registry (default: the process's).
    """

    def __init__(self, cfg: ServerConfig, add_servicers: Callable[[grpc.aio.Server], None],
                 service_names: Iterable[str], *, registry: CollectorRegistry = REGISTRY):
        self.cfg = cfg
        self.registry = registry
        self.service_names = list(service_names)
        limit = cfg.max_message_mb * 1024 * 1024
        token = read_token(cfg.backend_token_file) if cfg.backend_token_file else None
        self.grpc = grpc.aio.server(interceptors=[TokenInterceptor(token)] if token else None, options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ])
        add_servicers(self.grpc)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        if cfg.reflection:
            reflection.enable_server_reflection(
                [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.grpc)
        self.port = 0
        self.serving = False
        self.metrics: WSGIServer | None = None  # the /metrics endpoint once started, on cfg.host

    async def start(self) -> int:
        """Bind and start (and the /metrics endpoint); health says NOT_SERVING until ready(). Returns the port."""
        address = f"{self.cfg.host}:{self.cfg.port}"
        if self.cfg.tls_cert:
            creds = server_credentials(self.cfg.tls_cert, self.cfg.tls_key, self.cfg.tls_client_ca)
            self.port = self.grpc.add_secure_port(address, creds)
        else:
            self.port = self.grpc.add_insecure_port(address)
        if not self.port:
            raise OSError(f"could not bind {self.cfg.host}:{self.cfg.port}")
        await self.grpc.start()
        await self.set_serving(False)
        self.metrics = metrics.serve(self.cfg.metrics_port, self.cfg.host, registry=self.registry)
        log.info("gRPC listening on %s:%d%s%s (%s)", self.cfg.host, self.port,
                 " with TLS" + (" (client certificates required)" if self.cfg.tls_client_ca else "")
                 if self.cfg.tls_cert else "",
                 "; calls need the backend token" if self.cfg.backend_token_file
                 else "; WITHOUT authentication (--insecure-no-auth)", ", ".join(self.service_names))
        return self.port

    async def ready(self) -> None:
        """The models are loaded: report SERVING. Everything allocated so far (torch, the model's modules)
        lives as long as the process; frozen, it is never walked again, so a full collection visits only
        what requests allocated since (unfrozen, it walked ~400k objects in the pooling service and stalled
        the event loop for 100s of ms under load)."""
        gc.collect()
        gc.freeze()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING, refuse new calls, wait up to grace for in-flight ones."""
        await self.set_serving(False)
        await self.grpc.stop(self.cfg.drain_seconds if grace is None else grace)

    async def serve_until_signal(self) -> None:
        """Block until SIGTERM or SIGINT, then drain and stop."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        waiter = asyncio.ensure_future(self.grpc.wait_for_termination())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            log.info("signal received: draining for up to %.1fs", self.cfg.drain_seconds)
            await self.stop()
        waiter.cancel()
        stopper.cancel()
        log.info("stopped")


@dataclass
class Started:
    """A service up and serving: its server, and what releases the rest (engine, batchers, caches) once
    the server has stopped."""

    server: Server
    close: Callable[[], Awaitable[None]]
