"""Optional TLS between the services: PEM files -> gRPC server and channel credentials.

Off by default (loopback and a private cluster network are the common case); on, a
server presents --tls-cert/--tls-key and, with --tls-client-ca, demands a client
certificate signed by that CA (mutual TLS). The gateway verifies the services
against its --tls-ca and, for mutual TLS, presents --tls-client-cert/--tls-client-key.
Files are read once at start, so a missing or unreadable file is a start-up error
naming the flag, not a failed handshake later.
"""
from __future__ import annotations

from pathlib import Path

import grpc


def read_pem(path: str, flag: str) -> bytes:
    """The bytes of a PEM file, or a ValueError naming the flag (config validation turns it into a usage error)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path!r}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag}: {path!r} is not a PEM file")
    return data


def check_server_files(cert: str | None, key: str | None, client_ca: str | None) -> None:
    """Validate the server's TLS flags together (both or neither of cert and key; a client CA needs them)."""
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    if client_ca is not None and cert is None:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is on top of TLS)")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-client-ca", client_ca)):
        if path is not None:
            read_pem(path, flag)


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """Credentials for add_secure_port; with client_ca, clients without a certificate from that CA are refused."""
    pair = [(read_pem(key, "--tls-key"), read_pem(cert, "--tls-cert"))]
    if client_ca is None:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(pair, root_certificates=read_pem(client_ca, "--tls-client-ca"),
                                       require_client_auth=True)


def check_client_files(ca: str | None, cert: str | None, key: str | None) -> None:
    """Validate the gateway's TLS flags together."""
    if (cert is None) != (key is None):
        raise ValueError("--tls-client-cert and --tls-client-key go together: give both or neither")
    if cert is not None and ca is None:
        raise ValueError("--tls-client-cert needs --tls-ca (a client certificate is only sent over TLS)")
    for flag, path in (("--tls-ca", ca), ("--tls-client-cert", cert), ("--tls-client-key", key)):
        if path is not None:
            read_pem(path, flag)


def channel_credentials(ca: str, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    """Credentials for secure_channel: trust only `ca`; present cert/key when given (mutual TLS)."""
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, "--tls-ca"),
        private_key=read_pem(key, "--tls-client-key") if key else None,
        certificate_chain=read_pem(cert, "--tls-client-cert") if cert else None)
