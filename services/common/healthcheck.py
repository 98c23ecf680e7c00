"""A container health check: exit 0 when the target reports ready, 1 when not, 2 on bad usage.

    python -m services.common.healthcheck HOST:PORT [SERVICE]   # grpc.health.v1 Check
    python -m services.common.healthcheck http://HOST:PORT/PATH  # HTTP GET answers 2xx

Why a module and not grpc_health_probe: the images carry only what PyPI ships,
and a container should be "healthy" exactly when `make up` (deploy/launcher.py)
would call the same process ready. So this asks the same question the launcher
asks: SERVING for the named gRPC service (an empty name is the whole server),
or a 2xx from the gateway's /ready. A service still loading its model, or
draining after SIGTERM, answers NOT_SERVING and so is reported unhealthy.
"""
from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

OK, NOT_READY, USAGE = 0, 1, 2


def check_grpc(target: str, service: str, timeout: float) -> tuple[bool, str]:
    """(serving?, what was seen) for one grpc.health.v1 Check."""
    import grpc  # imported here so an HTTP check does not pay for grpc's import
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:  # unreachable, unknown service (NOT_FOUND), deadline
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def check_http(url: str, timeout: float) -> tuple[bool, str]:
    """(2xx?, what was seen) for one GET."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:  # noqa: S310 - the URL is our own argv
            return 200 <= reply.status < 300, f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:  # a 503 from /ready is an answer, not a crash
        return False, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"unreachable: {exc}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.healthcheck",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("target", help="HOST:PORT of a gRPC server, or an http:// URL")
    parser.add_argument("service", nargs="?", default="",
                        help="gRPC service name to check (default: '' = the whole server)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer (default: 2)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 on --help
        return int(exc.code or 0)
    if args.target.startswith(("http://", "https://")):
        if args.service:
            print("a service name only applies to gRPC targets", file=sys.stderr)
            return USAGE
        ok, seen = check_http(args.target, args.timeout)
    else:
        host, _, port = args.target.rpartition(":")
        if not host or not port.isdigit():
            print(f"target {args.target!r}: want HOST:PORT or an http:// URL", file=sys.stderr)
            return USAGE
        ok, seen = check_grpc(args.target, args.service, args.timeout)
    print(f"{' '.join(filter(None, (args.target, args.service)))}: {seen}")
    return OK if ok else NOT_READY


if __name__ == "__main__":
    sys.exit(main())
