"""VisionService over real gRPC with a real redis-server: health, reflection, Encode, cache hits,
every error code, a Redis outage mid-run, and the server still up after all of it."""
from __future__ import annotations

import io
import struct
import time
import zlib

import grpc
import pytest
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from PIL import Image

from services.common.errors import REASON_KEY, Unavailable
from services.common.pb import vision_pb2, vision_pb2_grpc
from services.common.tensors import from_proto
from services.vision.config import VisionConfig
from services.vision.service import SERVICE_NAME, VisionServicer

MAX_BYTES = 2_000_000


def request(*datas, mime=""):
    return vision_pb2.EncodeRequest(images=[vision_pb2.ImageData(data=d, mime_type=mime) for d in datas])


def fails(stub, req, code, reason):
    with pytest.raises(grpc.RpcError) as info:
        stub.Encode(req, timeout=30)
    assert info.value.code() == code, info.value.details()
    assert dict(info.value.trailing_metadata())[REASON_KEY] == reason
    return info.value.details()


def bomb_png(width, height) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (1, 1)).save(buf, "PNG")
    raw = buf.getvalue()
    chunk = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return raw[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + raw[33:]


@pytest.fixture
def served(vision_server, qwen_ckpt, redis_server):
    cfg = VisionConfig(model=str(qwen_ckpt), redis_url=redis_server, max_image_bytes=MAX_BYTES, max_images=3,
                       redis_backoff_s=0.2)
    address, servicer, _ = vision_server(cfg)
    with grpc.insecure_channel(address) as channel:
        yield vision_pb2_grpc.VisionServiceStub(channel), channel, servicer, redis_server


def test_unloaded_servicer_is_unavailable():
    servicer = VisionServicer(VisionConfig(model="unused"))
    with pytest.raises(Unavailable):
        servicer._ready()


def test_contract(served, photos):
    stub, channel, servicer, redis_url = served
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE_NAME):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
            health_pb2.HealthCheckResponse.SERVING
    reply = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert SERVICE_NAME in {s.name for s in reply.list_services_response.service}

    info = stub.GetModelInfo(vision_pb2.GetModelInfoRequest())
    assert info.recipe == "qwen2_vl" and info.hidden_size == 64 and info.encoder_revision == servicer.encoder.revision

    # Miss: two photos (and a duplicate) in one call -> one encoder forward.
    a, b = photos["chelsea.png"], photos["astronaut.png"]
    first = stub.Encode(request(a, b, a), timeout=60)
    assert servicer.stats.calls == 1 and servicer.stats.images == 2
    assert [im.cached for im in first.images] == [False, False, False]
    assert first.images[0].content_hash == first.images[2].content_hash != first.images[1].content_hash
    for im in first.images:
        rows = from_proto(im.rows, dtype=torch.float32, shape=(None, 64))
        # Post-merge grid: one row per decoder position.
        assert rows.shape[0] == im.grid.t * im.grid.h * im.grid.w
    assert (first.images[1].grid.t, first.images[1].grid.h, first.images[1].grid.w) == (1, 8, 8)

    # Hit: no decoding, no encoder, identical rows.
    second = stub.Encode(request(b, a), timeout=60)
    assert servicer.stats.calls == 1 and [im.cached for im in second.images] == [True, True]
    assert second.images[0].rows.data == first.images[1].rows.data
    assert second.images[1].content_hash == first.images[0].content_hash
    assert servicer.cache.stats.hits == 2

    # Every bad input: a clear status and reason, and the server keeps serving.
    png = io.BytesIO()
    Image.new("RGB", (40, 40), (1, 2, 3)).save(png, "PNG")
    png = png.getvalue()
    invalid, inv = grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"
    fails(stub, vision_pb2.EncodeRequest(), invalid, inv)
    fails(stub, request(png, png, png, png), invalid, "TOO_LARGE")
    fails(stub, request(b""), invalid, inv)
    fails(stub, request(png[: len(png) // 2]), invalid, inv)
    fails(stub, request(b"GIF89a but not really"), invalid, inv)
    fails(stub, request(b"just some text"), invalid, inv)
    fails(stub, request(b'<svg xmlns="http://www.w3.org/2000/svg"/>'), invalid, "UNSUPPORTED")
    fails(stub, request(png, mime="image/svg+xml"), invalid, "UNSUPPORTED")
    fails(stub, request(png, mime="application/pdf"), invalid, "UNSUPPORTED")
    fails(stub, request(bomb_png(20000, 20000)), invalid, "TOO_LARGE")
    fails(stub, request(png + b"\0" * MAX_BYTES), invalid, "TOO_LARGE")
    thin = io.BytesIO()
    Image.new("RGB", (300, 1)).save(thin, "PNG")
    assert "aspect ratio" in fails(stub, request(thin.getvalue()), invalid, inv)
    # A good image beside a bad one: the whole call fails and names the bad image.
    assert "image 1" in fails(stub, request(png, b""), invalid, inv)

    ok = stub.Encode(request(png), timeout=60)
    assert ok.images[0].grid.t == 1 and not ok.images[0].cached
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING


def test_salts_never_share_cached_rows(served, photos):
    """EncodeRequest.cache_salt (one per tenant, from the gateway) keys the rows: another salt, or none, is a
    miss; the same salt hits; rows and content hash are the image's either way."""
    stub, _, servicer, _ = served
    image = photos["coffee.png"]

    def encode(salt: str):
        req = request(image)
        req.cache_salt = salt
        return stub.Encode(req, timeout=60).images[0]
    first = encode("tenant-a")
    assert not first.cached
    assert not encode("tenant-b").cached and not encode("").cached
    again = encode("tenant-a")
    assert again.cached and encode("tenant-b").cached and encode("").cached
    assert again.rows.data == first.rows.data and again.content_hash == first.content_hash
    assert servicer.stats.calls == 3


def test_redis_outage_still_serves(served, photos):
    stub, _, servicer, redis_url = served
    a, b = photos["coffee.png"], photos["rocket.jpg"]
    before = stub.Encode(request(a), timeout=60).images[0]
    assert stub.Encode(request(a), timeout=60).images[0].cached
    redis.Redis.from_url(redis_url).shutdown(nosave=True)  # Redis goes away mid-run
    for data in (a, b, a):
        out = stub.Encode(request(data), timeout=60).images[0]
        assert not out.cached
    assert out.rows.data == before.rows.data and out.content_hash == before.content_hash
    assert servicer.cache.stats.errors >= 1
    assert servicer.stats.calls == 4  # a (miss), then b, a, ... all computed while Redis is down


def test_eviction_under_small_budget(vision_server, qwen_ckpt, redis_server, photos):
    """A budget that holds about one image: older entries are evicted, the budget is never exceeded."""
    cfg = VisionConfig(model=str(qwen_ckpt), redis_url=redis_server, cache_bytes=20_000, cache_prefix="small")
    address, servicer, _ = vision_server(cfg)
    with grpc.insecure_channel(address) as channel:
        stub = vision_pb2_grpc.VisionServiceStub(channel)
        for name in ("chelsea.png", "coffee.png", "rocket.jpg"):  # 54 rows x 64 floats = 13.8 kB each
            stub.Encode(request(photos[name]), timeout=60)
        assert not stub.Encode(request(photos["chelsea.png"]), timeout=60).images[0].cached  # evicted
        assert stub.Encode(request(photos["chelsea.png"]), timeout=60).images[0].cached
    r = redis.Redis.from_url(redis_server)
    assert int(r.get("small:bytes")) <= 20_000 and r.zcard("small:lru") == 1
    assert servicer.cache.stats.evictions == 3 and servicer.stats.calls == 4


def test_overload_is_resource_exhausted(vision_server, qwen_ckpt, photos):
    cfg = VisionConfig(model=str(qwen_ckpt), max_pending=1)
    address, servicer, loop = vision_server(cfg)
    loop.run(servicer._gate.acquire())  # the encoder is busy
    with grpc.insecure_channel(address) as channel:
        stub = vision_pb2_grpc.VisionServiceStub(channel)
        waiting = stub.Encode.future(request(photos["coffee.png"]), timeout=60)
        for _ in range(200):
            if servicer._pending:
                break
            time.sleep(0.01)
        fails(stub, request(photos["rocket.jpg"]), grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED")
        loop.loop.call_soon_threadsafe(servicer._gate.release)
        assert waiting.result().images[0].rows.shape[0] > 0
