"""The fleet's backend token: only callers holding it (the gateway) may use a backend's RPCs.

Every gRPC call to the decoder, vision and pooling services carries `authorization: Bearer <token>` metadata;
the server compares it in constant time and answers UNAUTHENTICATED otherwise. grpc.health.v1 stays open, so
probes (the launcher, container health checks, kubelets) need no secret. The token is read from a file
(--backend-token-file, env TESSERA_BACKEND_TOKEN_FILE, the same variable for every service and the gateway),
never from a flag or a variable's value: those show in `ps`, in the process environment and in the logged
config. `make up` writes one per fleet into its run folder (mode 0600); deploy/cluster and deploy/k8s mount one
as a secret file.
"""
from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

import grpc

# Shared by every service and the gateway: one secret per fleet, one variable naming where it is.
TOKEN_FILE_ENV = "TESSERA_BACKEND_TOKEN_FILE"
METADATA_KEY = "authorization"
# Shorter tokens are guessable; token_hex(32) (what the deployments generate) is 64 characters.
MIN_TOKEN_CHARS = 32
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
DENIED = "this backend answers only the fleet: the call needs 'authorization: Bearer <backend token>'"


def read_token(path: str, flag: str = "--backend-token-file") -> str:
    """The token in path (surrounding whitespace dropped), or a ValueError naming the flag."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag}: cannot read {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
    if len(token) < MIN_TOKEN_CHARS or any(ch.isspace() for ch in token):
        raise ValueError(f"{flag}: {path!r} must hold one token of at least {MIN_TOKEN_CHARS} characters"
                         " without spaces (e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return token


def new_token() -> str:
    """A fresh random token (64 hex characters)."""
    return secrets.token_hex(32)


def write_token(path: Path) -> Path:
    """Write a fresh token to path, readable by its owner only (0600), and return path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "w", encoding="utf-8") as out:
        out.write(new_token() + "\n")
    return path


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client adds to every call: nothing without a token."""
    return ((METADATA_KEY, f"Bearer {token}"),) if token else ()


def _denied_handler(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same kind as handler that answers UNAUTHENTICATED without running anything; for a
    method the server does not have (None), a streaming one, which reads nothing whatever the client sends."""
    async def deny(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

    if handler is None:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny)
    return grpc.stream_stream_rpc_method_handler(deny)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse every call but grpc.health.v1 unless it carries the token (compared in constant time). A method
    the server lacks is refused the same way, so a caller without the token cannot tell which services and
    methods exist (reflection off answers as reflection on does); with the token it is UNIMPLEMENTED."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def allowed(self, method: str, metadata) -> bool:
        if method.startswith(OPEN_PREFIXES):
            return True
        sent = [value for key, value in (metadata or ()) if key == METADATA_KEY]
        if len(sent) != 1:
            return False
        value = sent[0].encode() if isinstance(sent[0], str) else bytes(sent[0])
        return hmac.compare_digest(value, self._expected)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if self.allowed(handler_call_details.method, handler_call_details.invocation_metadata):
            return handler
        return _denied_handler(handler)
