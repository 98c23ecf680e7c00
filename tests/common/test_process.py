"""The one start-up of the gRPC services (services/common/process.py) and their per-service env prefixes."""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter
from safetensors.torch import save_file

from services.common import process
from services.common.server import Server, ServerConfig, Started
from tests.conftest import free_port

NAME = "tessera.test.v1.Nothing"
ROOT = Path(__file__).resolve().parents[2]


def services() -> dict[str, process.Service]:
    from services.decoder.__main__ import SERVICE as decoder
    from services.pooling.__main__ import SERVICE as pooling
    from services.vision.__main__ import SERVICE as vision
    return {"decoder": decoder, "vision": vision, "pooling": pooling}


@pytest.mark.parametrize("name, model_flag", [("decoder", "model"), ("vision", "model"),
                                              ("pooling", "embedding_model")])
def test_each_service_reads_its_own_prefix_only(name, model_flag, capsys):
    service = services()[name]
    assert service.env_prefix == f"TESSERA_{name.upper()}_"
    own = {f"{service.env_prefix}{model_flag.upper()}": "/m", f"{service.env_prefix}DRAIN_SECONDS": "3",
           f"{service.env_prefix}THREADS": "2"}
    server_cfg, cfg = process.load_config(service, [], environ=own)
    assert (getattr(cfg, model_flag), server_cfg.drain_seconds, server_cfg.threads) == ("/m", 3.0, 2)
    others = {f"TESSERA_{other.upper()}_{model_flag.upper()}": "/m" for other in ("decoder", "vision", "pooling",
                                                                                   "gateway") if other != name}
    with pytest.raises(SystemExit) as info:     # another service's variable does not configure this one
        process.load_config(service, [], environ=others)
    assert info.value.code == 2 and "is required" in capsys.readouterr().err


@pytest.mark.parametrize("name, argv", [("decoder", ["--model", "/m"]), ("vision", ["--model", "/m"]),
                                        ("pooling", ["--embedding-model", "/m"])])
def test_a_variable_named_before_the_prefixes_is_refused_with_its_new_name(name, argv, capsys):
    service = services()[name]
    process.load_config(service, argv, environ={})      # valid without it
    with pytest.raises(SystemExit) as info:
        process.load_config(service, argv, environ={"TESSERA_LOG_LEVEL": "DEBUG"})
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"TESSERA_LOG_LEVEL is no longer read: set {service.env_prefix}LOG_LEVEL instead" in err


def test_the_gateway_keys_moved_under_its_prefix(capsys):
    from gateway.config import ENV_PREFIX, GatewayConfig
    from services.common.config import load

    (cfg,) = load((GatewayConfig,), ["--pooling", "p:1"], prog="gw", description="", env_prefix=ENV_PREFIX,
                  environ={"TESSERA_GATEWAY_API_KEY": "k" * 16, "TESSERA_GATEWAY_ADMIN_KEY": "a" * 16})
    assert (cfg.api_key, cfg.admin_key) == ("k" * 16, "a" * 16)
    with pytest.raises(SystemExit):
        load((GatewayConfig,), ["--pooling", "p:1"], prog="gw", description="", env_prefix=ENV_PREFIX,
             environ={"TESSERA_API_KEY": "k"})
    assert "TESSERA_API_KEY is no longer read: set TESSERA_GATEWAY_API_KEY instead" in capsys.readouterr().err


def test_serve_reports_serving_exports_metrics_drains_on_sigterm_then_closes():
    registry = CollectorRegistry()
    Counter("tessera_test_calls", "calls", registry=registry).inc()
    metrics_port = free_port()
    closed = []

    async def start(server_cfg: ServerConfig, _cfg) -> Started:
        server = Server(server_cfg, lambda _s: None, [NAME], registry=registry)
        await server.start()
        await server.ready()

        async def close() -> None:
            closed.append(server.serving)
        return Started(server, close)

    service = process.Service(prog="t", description="t", env_prefix="T_", server_config=ServerConfig,
                              config=object, start=start)
    cfg = ServerConfig(host="127.0.0.1", port=free_port(), metrics_port=metrics_port, drain_seconds=1)

    gc.unfreeze()   # an earlier test's freeze must not pass for this one's

    async def scenario() -> None:
        serving = asyncio.ensure_future(process.serve(service, cfg, None))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cfg.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(100):
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=NAME), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.05)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode())
        assert "tessera_test_calls_total 1.0" in body
        assert gc.get_freeze_count() > 0       # Server.ready froze what start-up allocated
        os.kill(os.getpid(), signal.SIGTERM)   # the loop's handler drains and stops the server
        await asyncio.wait_for(serving, 10)

    asyncio.run(scenario())
    assert closed == [False]    # released after the server reported NOT_SERVING and stopped


def run_service(module: str, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *argv, "--host", "127.0.0.1", "--port", "0",
                           "--insecure-no-auth"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")})


def without_weights(src: Path, dst: Path, **config) -> Path:
    """src's files but its weights: one tensor no model has; config.json keys changed as given."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({"nothing.weight": torch.zeros(1)}, str(dst / "model.safetensors"))
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **config}))
    return dst


@pytest.mark.parametrize("module, argv", [
    ("services.pooling", ["--embedding-model", "{tmp}/minilm"]),      # no trained weights
    ("services.vision", ["--model", "{tmp}/vl"]),                     # no vision tower
    ("services.decoder", ["--model", "{models}/SmolLM2-135M-Instruct", "--dtype", "fp16"]),  # no fp16 on CPU
])
def test_what_the_service_cannot_serve_is_one_logged_line_and_status_1(module, argv, tmp_path):
    without_weights(ROOT / "models" / "all-MiniLM-L6-v2", tmp_path / "minilm")
    without_weights(ROOT / "models" / "qwen2-vl-random", tmp_path / "vl")
    done = run_service(module, [a.format(tmp=tmp_path, models=ROOT / "models") for a in argv])
    assert done.returncode == 1, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "cannot start:" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-2000:]


# A tiny Llama config.json (no weights needed: the refusals come before any is read).
LLAMA = {"model_type": "llama", "vocab_size": 160, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256}


def folder_with(path: Path, config: dict | None, *files: str) -> Path:
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    for name in files:
        (path / name).write_bytes(b"")
    return path


@pytest.mark.parametrize("module, flag, make, words", [
    ("services.decoder", "--model", lambda t: t / "absent", "absent is not a folder"),
    ("services.decoder", "--model", lambda t: folder_with(t / "m", {"model_type": "gemma9"}),
     "config.json model_type 'gemma9' is not supported (supported: llama, qwen2, qwen3, granite, olmo2, phi3, "
     "mistral, gemma2, gemma3_text, qwen3_moe, qwen2_moe, mixtral, qwen2_vl, qwen2_5_vl)"),
    ("services.decoder", "--model",
     lambda t: folder_with(t / "m", {**LLAMA, "rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}),
     "config.json rope_parameters.rope_type 'proportional' is not supported"),
    ("services.decoder", "--model", lambda t: folder_with(t / "m", {**LLAMA, "rope_scaling": {"type": "linear"}}),
     "config.json rope_scaling lacks 'factor', which rope_type 'linear' requires"),
    ("services.decoder", "--model", lambda t: folder_with(t / "m", LLAMA, "tokenizer.json"),
     "has no model.safetensors or model.safetensors.index.json"),
    ("services.decoder", "--model", lambda t: folder_with(t / "m", LLAMA, "model.safetensors"),
     "has no tokenizer.json"),
    ("services.pooling", "--embedding-model", lambda t: t / "absent", "absent: no config.json"),
    ("services.pooling", "--embedding-model",
     lambda t: without_weights(ROOT / "models" / "all-MiniLM-L6-v2", t / "m", model_type="nonesuch"),
     "config.json model_type 'nonesuch' is not a family the pooling service serves"),
    ("services.vision", "--model", lambda t: t / "absent", "absent: no config.json"),
    ("services.vision", "--model", lambda t: folder_with(t / "m", {"model_type": "gemma9"}),
     "config.json model_type 'gemma9' is not supported (supported: qwen2_vl, qwen2_5_vl, tessera_demo_vision)"),
])
def test_a_folder_the_service_cannot_serve_is_one_line_and_status_2(module, flag, make, words, tmp_path):
    """A usage error, before anything starts: one line on stderr naming the missing piece and its config key
    or file, no log lines, no traceback, no event-loop noise."""
    folder = make(tmp_path)
    done = run_service(module, [flag, str(folder)])
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr[-2000:]
    assert done.stderr.startswith(f"python -m {module}: cannot serve: ") and words in done.stderr, done.stderr
    assert done.stdout == ""


def test_no_former_name_is_a_variable_of_today():
    """Every container of the k8s ConfigMap receives every service's keys: a key another service reads must
    never look like a former name this service refuses."""
    from gateway.config import ENV_PREFIX as GATEWAY_PREFIX
    from gateway.config import GatewayConfig
    from services.common.config import FORMER_PREFIX

    current = {GATEWAY_PREFIX + f.name.upper() for f in dataclasses.fields(GatewayConfig)}
    former = set()
    for service in services().values():
        fields = [*dataclasses.fields(service.server_config), *dataclasses.fields(service.config)]
        current |= {service.env_prefix + f.name.upper() for f in fields if not f.metadata.get("env")}
        former |= {FORMER_PREFIX + f.name.upper() for f in fields if not f.metadata.get("env")}
    assert former and current and not former & current
