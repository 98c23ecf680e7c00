"""LoRA adapters end to end: the real SmolLM2 decoder with the two demo adapters `make models` trains (pirate,
french), behind the real gateway, through the official `openai` client and plain HTTP.

One decoder for the module, with both demo adapters preloaded and a --lora-root holding a copy of one of them
plus folders the loader must refuse. Checked: each adapter and the base model answer with their own behaviour
in concurrent requests; /v1/models lists the adapters with their parent; runtime load/use/unload through the
admin endpoints; every refusal (no key, wrong key, disabled, outside the root, missing folder, refused PEFT
features, a leased name, an unknown adapter) is a clear OpenAI error, leaves the adapters as they were, and
the fleet keeps serving.
"""
from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from deploy.adapters import DEMO_ADAPTERS
from deploy.models import ADAPTERS_DIR
from gateway.config import GatewayConfig
from tests.conftest import free_port
from tests.decoder.server.conftest import need_smollm2
from tests.gateway.fleet import GatewayThread, python_module, stop, wait_serving

BASE = "SmolLM2-135M-Instruct"
USER_KEY, ADMIN_KEY = "sk-adapters-user-key", "sk-adapters-admin-key"
MARKERS = {a.name: a.marker for a in DEMO_ADAPTERS}  # pirate -> "Arr", french -> "Bonjour"
QUESTION = [{"role": "user", "content": "What is the capital of Italy?"}]  # not in the adapters' training set


def demo_adapter(name: str) -> Path:
    folder = need_smollm2().parent / ADAPTERS_DIR / name
    if not (folder / "adapter_model.safetensors").is_file():
        pytest.fail(f"{folder} is missing: run `make models` (make test does)")
    return folder


def refused_copy(src: Path, dest: Path, **config) -> None:
    """A copy of a real adapter whose adapter_config.json asks for a feature the loader refuses."""
    shutil.copytree(src, dest)
    path = dest / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    root = tmp / "root"
    root.mkdir()
    pirate, french = demo_adapter("pirate"), demo_adapter("french")
    shutil.copytree(pirate, root / "pirate-copy")
    refused_copy(pirate, root / "dora", use_dora=True)
    refused_copy(pirate, root / "rslora", use_rslora=True)
    shutil.copytree(french, tmp / "outside")
    (root / "escape").symlink_to(tmp / "outside")  # a symlink inside the root that leads out of it
    port = free_port()
    decoder = python_module("services.decoder", [
        "--model", str(need_smollm2()), "--host", "127.0.0.1", "--port", str(port), "--num-blocks", "256",
        "--threads", "1", "--max-loras", "2", "--lora", f"pirate={pirate}", "--lora", f"french={french}",
        "--lora-root", str(root)], tmp / "decoder.log")
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, "tessera.decoder.v1.DecoderService", decoder)
        cfg = GatewayConfig(host="127.0.0.1", port=free_port(), decoder=(address,), api_key=USER_KEY,
                            admin_key=ADMIN_KEY)
        with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
            yield {"client": openai.OpenAI(base_url=gw.url + "/v1", api_key=USER_KEY, max_retries=0),
                   "http": http, "url": gw.url, "address": address, "decoder": decoder}
    finally:
        stop(decoder)


ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
USER = {"Authorization": f"Bearer {USER_KEY}"}


def answer(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
    assert reply.model == model
    return reply.choices[0].message.content


def error_of(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


def first_token(lines) -> str:
    """Read SSE lines up to the first content delta that carries text (keep `lines` alive: dropping the
    response would close it, which the gateway rightly takes as the client leaving)."""
    for line in lines:
        if line.startswith("data: {"):
            choices = json.loads(line[len("data: "):])["choices"]
            if choices and choices[0]["delta"].get("content"):
                return choices[0]["delta"]["content"]
    pytest.fail("the stream ended before any text")


def registered(http: httpx.Client) -> dict[str, dict]:
    listing = http.get("/v1/lora_adapters", headers=ADMIN)
    assert listing.status_code == 200, listing.text
    return {a["id"]: a for a in listing.json()["data"]}


def test_demo_adapters_and_base_in_concurrent_requests(fleet):
    client = fleet["client"]
    models = ["pirate", "french", BASE] * 2
    with ThreadPoolExecutor(len(models)) as pool:
        answers = list(pool.map(lambda m: answer(client, m), models))
    by_model = dict(zip(models, answers, strict=True))
    assert answers[:3] == answers[3:], answers  # greedy: the same answer however the batch was mixed
    for name, marker in MARKERS.items():
        assert by_model[name].startswith(marker), by_model
    assert not by_model[BASE].startswith(tuple(MARKERS.values())), by_model
    # Streaming takes the same path.
    stream = client.chat.completions.create(model="french", messages=QUESTION, max_tokens=8, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == by_model["french"]


def test_models_lists_adapters_with_their_parent(fleet):
    cards = {m.id: m for m in fleet["client"].models.list().data}
    assert {BASE, "pirate", "french"} <= set(cards)
    for name in ("pirate", "french"):
        extra = cards[name].model_extra
        assert extra["parent"] == BASE and extra["root"] == BASE and extra["kind"] == "generation"
        assert extra["rank"] == 8 and extra["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert cards[BASE].model_extra["parent"] is None and cards[BASE].model_extra["max_loras"] == 2
    assert fleet["client"].models.retrieve("pirate").model_extra["parent"] == BASE


def test_unknown_adapter_is_404(fleet):
    with pytest.raises(openai.NotFoundError) as caught:
        answer(fleet["client"], "no-such-adapter")
    assert "no-such-adapter" in str(caught.value)


def test_tokenize_routes_an_adapter_name_to_its_base(fleet):
    http = fleet["http"]
    chat = {"messages": QUESTION}
    by_model = {m: http.post("/tokenize", json={"model": m, **chat}, headers=USER) for m in (BASE, "pirate")}
    assert all(r.status_code == 200 for r in by_model.values()), by_model
    assert by_model["pirate"].json() == by_model[BASE].json()
    done = fleet["client"].chat.completions.create(model="pirate", messages=QUESTION, max_tokens=1)
    assert done.usage.prompt_tokens == by_model["pirate"].json()["count"]
    back = http.post("/detokenize", json={"model": "french", "tokens": by_model[BASE].json()["tokens"]}, headers=USER)
    assert back.status_code == 200 and "What is the capital of Italy?" in back.json()["prompt"]
    missing = http.post("/tokenize", json={"model": "no-such-adapter", "prompt": "hi"}, headers=USER)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_admin_endpoints_need_the_admin_key(fleet):
    http = fleet["http"]
    load = {"lora_name": "sneaky", "lora_path": "pirate-copy"}
    for path, body in (("/v1/load_lora_adapter", load), ("/v1/unload_lora_adapter", {"lora_name": "pirate"})):
        assert "admin key" in error_of(http.post(path, json=body), 401)["message"]
        assert error_of(http.post(path, json=body, headers=USER), 403)["type"] == "permission_error"
        error_of(http.post(path, json=body, headers={"Authorization": "Bearer wrong"}), 403)
    error_of(http.get("/v1/lora_adapters", headers=USER), 403)
    assert set(registered(http)) == {"pirate", "french"}  # nothing was loaded or unloaded
    # A gateway started without an admin key keeps the endpoints off, and says how to turn them on.
    cfg = GatewayConfig(host="127.0.0.1", port=free_port(), decoder=(fleet["address"],))
    with GatewayThread(cfg) as gw:
        off = error_of(httpx.post(gw.url + "/v1/load_lora_adapter", json=load, headers=ADMIN, timeout=30), 403)
        assert "--admin-key" in off["message"]


def test_load_use_and_unload_at_run_time(fleet):
    http, client = fleet["http"], fleet["client"]
    loaded = http.post("/v1/load_lora_adapter", headers=ADMIN,
                       json={"lora_name": "pirate2", "lora_path": "pirate-copy"})
    assert loaded.status_code == 200, loaded.text
    card = loaded.json()
    assert card["id"] == "pirate2" and card["parent"] == BASE and card["rank"] == 8
    # The same weights as the preloaded pirate: the same content digest.
    assert card["digest"] == registered(http)["pirate"]["digest"]
    assert "pirate2" in {m.id for m in client.models.list().data}  # listed right after the load
    assert answer(client, "pirate2").startswith(MARKERS["pirate"])
    unloaded = http.post("/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": "pirate2"})
    assert unloaded.status_code == 200 and unloaded.json()["deleted"] is True
    assert "pirate2" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        answer(client, "pirate2")
    error_of(http.post("/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": "pirate2"}), 404)


@pytest.mark.parametrize(("path", "status", "words"), [
    ("../outside", 400, "outside the adapter root"),
    ("escape", 400, "outside the adapter root"),            # a symlink out of the root
    ("/etc", 400, "outside the adapter root"),
    ("missing", 404, "does not exist"),
    ("dora", 400, "DoRA"),
    ("rslora", 400, "use_rslora"),
])
def test_refused_loads_change_nothing(fleet, path, status, words):
    http = fleet["http"]
    err = error_of(http.post("/v1/load_lora_adapter", headers=ADMIN, json={"lora_name": "bad", "lora_path": path}),
                   status)
    assert words in err["message"], err
    assert set(registered(http)) == {"pirate", "french"}
    assert "bad" not in {m.id for m in fleet["client"].models.list().data}


def test_bad_admin_bodies_are_400(fleet):
    http = fleet["http"]
    error_of(http.post("/v1/load_lora_adapter", headers=ADMIN, json={"lora_name": "x"}), 400)  # no lora_path
    error_of(http.post("/v1/load_lora_adapter", headers=ADMIN, json={"lora_name": "x", "lora_path": "pirate-copy",
                                                                     "slot": 0}), 400)  # clients never name slots
    err = error_of(http.post("/v1/load_lora_adapter", headers=ADMIN,
                             json={"lora_name": "bad name!", "lora_path": "pirate-copy"}), 400)
    assert err["param"] == "lora_name"
    err = error_of(http.post("/v1/load_lora_adapter", headers=ADMIN,
                             json={"lora_name": "x", "lora_path": "pirate-copy", "base_model": "nope"}), 404)
    assert err["param"] == "base_model"
    assert set(registered(http)) == {"pirate", "french"}


def test_a_leased_adapter_is_neither_unloaded_nor_replaced(fleet):
    http = fleet["http"]
    assert http.post("/v1/load_lora_adapter", headers=ADMIN,
                     json={"lora_name": "held", "lora_path": "pirate-copy"}).status_code == 200
    body = {"model": "held", "messages": QUESTION, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(base_url=fleet["url"], timeout=60) as streaming, \
            streaming.stream("POST", "/v1/chat/completions", json=body, headers=USER) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        first_token(lines)  # the request is running: its lease is held
        err = error_of(http.post("/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": "held"}), 409)
        assert "running requests" in err["message"] and err["param"] == "lora_name"
        err = error_of(http.post("/v1/load_lora_adapter", headers=ADMIN,
                                 json={"lora_name": "held", "lora_path": "pirate-copy"}), 409)
        assert err["type"] == "conflict_error"
        assert registered(http)["held"]["replicas"][0]["running_requests"] == 1
    # The client left: the gateway cancels the call, the decoder aborts it and the lease returns.
    deadline = time.time() + 30
    while registered(http)["held"]["replicas"][0]["running_requests"] and time.time() < deadline:
        time.sleep(0.1)
    assert http.post("/v1/unload_lora_adapter", headers=ADMIN, json={"lora_name": "held"}).status_code == 200
    assert set(registered(http)) == {"pirate", "french"}


def test_the_fleet_still_serves_after_every_refusal(fleet):
    assert fleet["decoder"].poll() is None
    assert fleet["http"].get("/ready").status_code == 200
    assert answer(fleet["client"], "pirate").startswith(MARKERS["pirate"])
