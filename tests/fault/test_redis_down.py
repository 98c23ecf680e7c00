"""Kill Redis under a real image fleet (redis-server, vision service, a tiny random Qwen2-VL decoder, the gateway):
image chats keep being answered, the same as before, because the feature cache is only a cache."""
from __future__ import annotations

import base64

import httpx

from gateway.config import GatewayConfig
from tests.conftest import free_port
from tests.decoder.multimodal.conftest import photo
from tests.gateway.fleet import GatewayThread, python_module, redis_process, stop, wait_serving
from tests.vision.checkpoints import write_qwen2_vl

VL = "tiny-vl"


def image_chat(name: str) -> dict:
    url = f"data:image/png;base64,{base64.b64encode(photo(name)).decode()}"
    return {"model": VL, "temperature": 0, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}]}


def test_redis_killed_mid_run_image_chats_still_answered(tmp_path):
    ckpt = write_qwen2_vl(tmp_path / "tiny-qwen2-vl", seed=7)
    ports = {name: free_port() for name in ("redis", "vision", "vl")}
    procs = [redis_process(ports["redis"], tmp_path)]
    try:
        procs.append(python_module("services.vision", [
            "--model", str(ckpt), "--host", "127.0.0.1", "--port", str(ports["vision"]), "--threads", "1",
            "--redis-url", f"redis://127.0.0.1:{ports['redis']}/0", "--redis-backoff-s", "0.5"],
            tmp_path / "vision.log"))
        procs.append(python_module("services.decoder", [
            "--model", str(ckpt), "--served-model-name", VL, "--host", "127.0.0.1", "--port", str(ports["vl"]),
            "--num-blocks", "512", "--block-size", "4", "--max-num-batched-tokens", "64", "--max-model-len", "1024",
            "--threads", "1", "--max-loras", "0"], tmp_path / "decoder.log"))
        vision, vl = f"127.0.0.1:{ports['vision']}", f"127.0.0.1:{ports['vl']}"
        wait_serving(vision, "tessera.vision.v1.VisionService", procs[1])
        wait_serving(vl, "tessera.decoder.v1.DecoderService", procs[2])
        cfg = GatewayConfig(host="127.0.0.1", port=free_port(), decoder=(vl,), vision=vision)
        with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=120) as http:
            before = http.post("/v1/chat/completions", json=image_chat("coffee.png"))
            assert before.status_code == 200, before.text
            procs[0].kill()   # Redis goes away mid-run
            procs[0].wait(10)
            for name in ("coffee.png", "chelsea.png", "coffee.png"):   # a cached image, a new one, the cached again
                reply = http.post("/v1/chat/completions", json=image_chat(name))
                assert reply.status_code == 200, reply.text
                if name == "coffee.png":   # recomputed rows give the same greedy answer as the cached ones did
                    assert reply.json()["choices"][0]["message"] == before.json()["choices"][0]["message"]
            assert http.get("/ready").status_code == 200   # Redis is not a backend the gateway waits for
    finally:
        for proc in reversed(procs):
            stop(proc)
