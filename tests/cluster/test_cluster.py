"""The compose cluster, driven from the host through the gateway's published port with the official openai
client, then broken: a decoder killed, Redis stopped, the gateway sent SIGTERM mid-stream. Last, `down`
must leave no container, pod, network or volume behind.

The tests run in this order and share one cluster (the `cluster` fixture, tests/cluster/conftest.py); each
fault test puts back what it broke, so the next starts from a healthy fleet.
"""
from __future__ import annotations

import base64
import io
import re
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from deploy import cluster as cluster_mod
from deploy.adapters import DEMO_ADAPTERS
from deploy.models import MINILM, QWEN2_VL_RANDOM, SMOLLM2

# No engine, and none may be installed here: the whole module is skipped, one line saying why (never passed).
try:
    cluster_mod.find_engine(install=not cluster_mod.settings().no_install)
except cluster_mod.EngineUnavailable as exc:
    pytest.skip(f"cluster test NOT RUN: {exc}", allow_module_level=True)

GATEWAY = cluster_mod.GATEWAY_URL
PIRATE = next(a for a in DEMO_ADAPTERS if a.name == "pirate")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    # max_retries=0: a 503 must reach the test as it was answered, not be retried away.
    return openai.OpenAI(base_url=f"{GATEWAY}/v1", api_key="unused", max_retries=0, timeout=120)


def ready_status() -> int | None:
    try:
        return httpx.get(f"{GATEWAY}/ready", timeout=5).status_code
    except httpx.HTTPError:
        return None


def wait_ready(status: int, timeout: float) -> float:
    """Poll /ready until it answers `status`; seconds it took."""
    started = time.monotonic()
    seen = None
    while time.monotonic() - started < timeout:
        seen = ready_status()
        if seen == status:
            return time.monotonic() - started
        time.sleep(0.5)
    raise AssertionError(f"/ready did not answer {status} within {timeout:.0f}s (last: {seen})")


def png_data_uri(seed: int, size: int = 224) -> str:
    """A picture no earlier run has sent (random pixels), so its first chat is a vision cache miss."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_chat(client: openai.OpenAI, uri: str):
    return client.chat.completions.create(model=QWEN2_VL_RANDOM, temperature=0, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                     {"type": "text", "text": "What is in this picture?"}]}])


def images_by_source() -> dict[str, float]:
    """The gateway's count of images by where the vision service got their rows: cache (Redis) or encoder."""
    text = httpx.get(f"{GATEWAY}/metrics", timeout=10).text
    found = dict.fromkeys(("cache", "encoder"), 0.0)
    for source, value in re.findall(r'^tessera_gateway_images_total\{source="(\w+)"\} ([\d.e+]+)$', text, re.M):
        found[source] = float(value)
    return found


def cached_tokens(reply) -> int:
    details = reply.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


# -- the fleet answers -------------------------------------------------------------------------------------

def test_ready_is_200(cluster):
    assert ready_status() == 200


def test_text_chat(client):
    reply = client.chat.completions.create(model=SMOLLM2, messages=QUESTION, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content.strip()
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0


def test_pirate_adapter_answers_in_its_voice(client):
    pirate = client.chat.completions.create(model="pirate", messages=QUESTION, max_tokens=16, temperature=0)
    base = client.chat.completions.create(model=SMOLLM2, messages=QUESTION, max_tokens=16, temperature=0)
    assert pirate.model == "pirate"
    assert pirate.choices[0].message.content.startswith(PIRATE.marker), pirate.choices[0].message.content
    assert not base.choices[0].message.content.startswith(PIRATE.marker)


def test_embeddings(client):
    reply = client.embeddings.create(model=MINILM, input=["a cat sat on the mat", "the stock market fell"])
    vectors = [np.array(d.embedding) for d in reply.data]
    assert [d.index for d in reply.data] == [0, 1]
    assert all(v.shape == (384,) and np.isfinite(v).all() for v in vectors)
    assert not np.allclose(vectors[0], vectors[1])
    assert reply.usage.prompt_tokens > 0


def test_image_chat_twice_second_is_a_vision_cache_hit_and_a_prefix_hit(client):
    uri = png_data_uri(time.time_ns())
    before = images_by_source()
    first = image_chat(client, uri)
    middle = images_by_source()
    second = image_chat(client, uri)
    after = images_by_source()
    assert (middle["encoder"] - before["encoder"], middle["cache"] - before["cache"]) == (1, 0), "first: computed"
    assert (after["encoder"] - middle["encoder"], after["cache"] - middle["cache"]) == (0, 1), "second: from Redis"
    # usage says the same: one image each time, from the feature cache the second time.
    assert first.usage.prompt_tokens_details.model_extra == {"images": 1, "cached_images": 0}, first.usage
    assert second.usage.prompt_tokens_details.model_extra == {"images": 1, "cached_images": 1}, second.usage
    # The prefix cache: the second prompt's blocks, image rows included, come from the first one's KV.
    assert cached_tokens(second) > cached_tokens(first), (first.usage, second.usage)
    assert cached_tokens(second) >= second.usage.prompt_tokens // 2, second.usage
    assert second.choices[0].message.content == first.choices[0].message.content  # greedy: the same noise


# -- faults -------------------------------------------------------------------------------------------------

def test_decoder_killed_ready_503_then_compose_up_recovers(cluster, client):
    cid = cluster.container("decoder", running=True)
    assert cid, "no running decoder container"
    cluster("kill", cid)
    wait_ready(503, 60)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=SMOLLM2, messages=QUESTION, max_tokens=4)
    assert refused.value.status_code == 503, refused.value
    # Other models keep being served while that one is down.
    assert client.embeddings.create(model=MINILM, input=["still here"]).data
    cluster_mod.compose_up(cluster, "decoder")
    cluster_mod.wait_healthy(cluster, 300, ["decoder"])
    wait_ready(200, 120)  # the gateway finds the decoder again on its own; nothing restarts it
    reply = client.chat.completions.create(model=SMOLLM2, messages=QUESTION, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content.strip()


def test_redis_stopped_image_chats_still_answer(cluster, client):
    seen = png_data_uri(time.time_ns())
    before = image_chat(client, seen)
    cluster.compose("stop", "redis")
    assert cluster.container("redis", running=True) is None
    try:
        for uri in (seen, png_data_uri(time.time_ns() + 1), seen):  # a cached image, a new one, the cached again
            reply = image_chat(client, uri)
            assert reply.choices[0].message.content is not None
            if uri == seen:  # recomputed rows give the same greedy answer as the cached ones did
                assert reply.choices[0].message.content == before.choices[0].message.content
        assert ready_status() == 200  # Redis is a cache, not a backend the gateway waits for
    finally:
        cluster_mod.compose_up(cluster, "redis")
        cluster_mod.wait_healthy(cluster, 60, ["redis"])


def test_gateway_sigterm_mid_stream_the_stream_completes(cluster, client):
    n = 96
    stream = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Tell me a long story about the sea."}],
        max_tokens=n, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"min_tokens": n})  # no early end of sequence: the stream surely outlives the signal
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices
    gateway = cluster.container("gateway", running=True)
    cluster("kill", "--signal", "TERM", gateway)
    signalled = time.monotonic()
    rest = list(chunks)
    finished = time.monotonic()
    text = "".join(c.choices[0].delta.content or "" for c in [first, *rest] if c.choices)
    reasons = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in rest if c.usage is not None]
    assert reasons == ["length"], reasons
    assert usage and usage[-1].completion_tokens == n, usage
    assert text.strip()
    assert finished - signalled > 0.2, "the stream ended before the signal could matter"
    # The signal was taken: the gateway drains and exits (its restart policy or compose may start a new one).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if cluster.container("gateway", running=True) != gateway or restarted(cluster, gateway, signalled):
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the gateway did not exit after SIGTERM")
    cluster_mod.compose_up(cluster, "gateway")
    wait_ready(200, 120)


def restarted(engine: cluster_mod.Engine, cid: str, since: float) -> bool:
    """True when the container is not running, or was started again after the signal (restart policy)."""
    done = engine("inspect", "--format", "{{.State.Running}} {{.RestartCount}}", cid, check=False)
    running, _, count = done.stdout.strip().partition(" ")
    return running != "true" or (count.isdigit() and int(count) > 0)


# -- down -----------------------------------------------------------------------------------------------------

def test_cluster_down_leaves_no_container_pod_network_or_volume(cluster):
    left = cluster_mod.down(cluster)
    assert left == [], left
    assert cluster.leftovers() == []
    assert ready_status() is None  # nothing answers on the gateway's port any more
