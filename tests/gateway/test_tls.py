"""TLS between the gateway and a service (services/common/tls.py): a real pooling process with a certificate from a
CA made here with the openssl CLI, requiring client certificates (mutual TLS), behind the real gateway."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from services.common.server import ServerConfig
from tests.conftest import free_port
from tests.gateway.fleet import GatewayThread, python_module, stop
from tests.pooling.conftest import minilm_dir, tiny_bert_dir  # noqa: F401 - fixtures shared with the pooling tests

POOLING = "tessera.pooling.v1.PoolingService"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """ca.pem; server.pem/key (SAN IP:127.0.0.1) and client.pem/key, both signed by the CA; other-ca.pem."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl CLI is needed to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "1",
                "-subj", f"/CN=tessera {ca}", cwd=d)
    for name, san in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=tessera {name}", cwd=d)
        (d / f"{name}.ext").write_text(san + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
    return d


def serving(address: str, creds: grpc.ChannelCredentials | None) -> str:
    channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=POOLING),
                                                              timeout=2)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_flags_are_checked_at_start(pki):
    with pytest.raises(ValueError, match="go together"):
        ServerConfig(tls_cert=str(pki / "server.pem"))
    with pytest.raises(ValueError, match="not a PEM file"):
        ServerConfig(tls_cert=str(pki / "server.ext"), tls_key=str(pki / "server.key"))
    with pytest.raises(ValueError, match="needs --tls-ca"):
        GatewayConfig(decoder=("127.0.0.1:1",), tls_client_cert=str(pki / "client.pem"),
                      tls_client_key=str(pki / "client.key"))


def test_mutual_tls_between_gateway_and_pooling(pki, tmp_path, tiny_bert_dir):  # noqa: F811
    port = free_port()
    address = f"127.0.0.1:{port}"
    proc = python_module("services.pooling", [
        "--embedding-model", str(tiny_bert_dir), "--embedding-name", "tiny-bert", "--host", "127.0.0.1",
        "--port", str(port), "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
        "--tls-client-ca", str(pki / "ca.pem")], tmp_path / "pooling.log")
    ca, cert, key = ((pki / n).read_bytes() for n in ("ca.pem", "client.pem", "client.key"))
    mutual = grpc.ssl_channel_credentials(ca, key, cert)
    try:
        deadline = time.monotonic() + 60
        while serving(address, mutual) != "SERVING":
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "pooling.log").read_text()[-2000:]
            time.sleep(0.1)
        # Plaintext, a client without a certificate, and a client trusting another CA are all refused.
        assert serving(address, None) == "UNAVAILABLE"
        assert serving(address, grpc.ssl_channel_credentials(ca)) == "UNAVAILABLE"
        other = grpc.ssl_channel_credentials((pki / "other-ca.pem").read_bytes(), key, cert)
        assert serving(address, other) == "UNAVAILABLE"

        good = GatewayConfig(host="127.0.0.1", port=free_port(), pooling=address, tls_ca=str(pki / "ca.pem"),
                             tls_client_cert=str(pki / "client.pem"), tls_client_key=str(pki / "client.key"))
        no_cert = GatewayConfig(host="127.0.0.1", port=free_port(), pooling=address, tls_ca=str(pki / "ca.pem"))
        with GatewayThread(good) as gw, GatewayThread(no_cert) as gw_no_cert:
            reply = httpx.post(f"{gw.url}/v1/embeddings", json={"input": "over TLS"}, timeout=30)
            assert reply.status_code == 200 and len(reply.json()["data"]) == 1, reply.text
            assert httpx.get(f"{gw.url}/ready", timeout=10).status_code == 200
            refused = httpx.post(f"{gw_no_cert.url}/v1/embeddings", json={"input": "no cert"}, timeout=30)
            assert refused.status_code == 503, refused.text
    finally:
        stop(proc)
