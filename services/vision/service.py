"""VisionService over gRPC: validate, hash, look in the feature cache, decode + encode the misses.

Per image, Encode returns rows [t*h*w, hidden] float32, the MERGED grid (t, h, w)
with t*h*w == rows (one decoder position per row), the content hash and
whether the rows came from the cache. The encoder loads after the server
starts: health says NOT_SERVING meanwhile and calls get UNAVAILABLE.
"""
from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from PIL import Image
from prometheus_client import Counter, Histogram

from services.common import compute
from services.common.data_uri import check_mime
from services.common.errors import InvalidArgument, Overloaded, TooLarge, Unavailable, grpc_errors
from services.common.metrics import LATENCY_BUCKETS
from services.common.pb import common_pb2, vision_pb2, vision_pb2_grpc
from services.common.server import Server, Started
from services.common.tensors import to_proto
from services.vision import encoder as encoder_mod
from services.vision.cache import Entry, FeatureCache, cache_key
from services.vision.config import VisionConfig, VisionServerConfig
from services.vision.image import Limits, decode

log = logging.getLogger("tessera.vision")
SERVICE_NAME = vision_pb2.DESCRIPTOR.services_by_name["VisionService"].full_name

_IMAGES = Counter("tessera_vision_images", "images answered, by source", ["source"])
_ENCODE_SECONDS = Histogram("tessera_vision_encode_seconds", "decode + preprocess + encoder time of one call's misses",
                            buckets=LATENCY_BUCKETS)


@dataclass
class EncoderStats:
    calls: int = 0   # encoder forwards
    images: int = 0  # images through the encoder


class VisionServicer(vision_pb2_grpc.VisionServiceServicer):
    def __init__(self, cfg: VisionConfig):
        self.cfg = cfg
        self.limits = Limits(cfg.max_image_bytes, cfg.max_pixels)
        self.encoder: encoder_mod.Encoder | None = None
        self.recipe_config: dict = {}
        self.cache: FeatureCache | None = None
        self.stats = EncoderStats()
        self._gate = asyncio.Semaphore(1)  # one encoder forward at a time; the CPU threads are shared
        # Always the same thread: torch on several long-lived threads throttles them all (services/common/compute.py).
        self._forward = ThreadPoolExecutor(1, thread_name_prefix="encoder")
        self._pending = 0

    def load(self) -> None:
        """Load the encoder (blocking; run it off the event loop)."""
        # PIL's own bomb guard agrees with ours (it raises at 2x; we refuse at 1x from the header).
        Image.MAX_IMAGE_PIXELS = self.cfg.max_pixels
        enc = encoder_mod.load(self.cfg.model, self.cfg.dtype, self.cfg.device, self.cfg.recipe)
        self.recipe_config = enc.recipe.config()
        self.encoder = enc

    def _ready(self) -> encoder_mod.Encoder:
        if self.encoder is None:
            raise Unavailable("the vision encoder is still loading")
        return self.encoder

    def _validate(self, images) -> None:
        """Cheap checks before any hashing, cache traffic or decoding."""
        if not images:
            raise InvalidArgument("at least one image is required", param="images")
        if len(images) > self.cfg.max_images:
            # The decoder's wording and kind for the same rule (services/decoder/server/validation.py).
            raise TooLarge(f"{len(images)} images in one request; at most {self.cfg.max_images} per request",
                           param="images")
        for i, im in enumerate(images):
            if not im.data:
                raise InvalidArgument(f"image {i} is empty", param=f"images[{i}]")
            if len(im.data) > self.cfg.max_image_bytes:
                raise TooLarge(f"image {i} is {len(im.data)} bytes; the limit is {self.cfg.max_image_bytes}",
                               param=f"images[{i}]")
            if im.mime_type:
                check_mime(im.mime_type, param=f"images[{i}]")

    def _compute(self, enc: encoder_mod.Encoder, items: list[tuple[int, bytes, str]]) -> list[Entry]:
        """Decode, preprocess and encode (blocking): items are (index, bytes, mime) -> one Entry each."""
        prepared = [enc.recipe(decode(data, self.limits, mime, param=f"images[{i}]")) for i, data, mime in items]
        rows = enc.encode(prepared)
        self.stats.calls += 1
        self.stats.images += len(prepared)
        return [Entry(r, enc.merged_grid(p.grid)) for r, p in zip(rows, prepared, strict=True)]

    @grpc_errors
    async def Encode(self, request, context):
        enc = self._ready()
        images = list(request.images)
        self._validate(images)
        if self._pending >= self.cfg.max_pending:
            raise Overloaded(f"{self._pending} Encode calls are already waiting; retry later")
        self._pending += 1
        try:
            return await self._encode(enc, images, request.cache_salt)
        finally:
            self._pending -= 1

    async def _encode(self, enc: encoder_mod.Encoder, images, salt: str = "") -> vision_pb2.EncodeResponse:
        hashes = await asyncio.to_thread(
            lambda: [encoder_mod.content_hash(im.data, self.recipe_config, enc.revision) for im in images])
        unique = list(dict.fromkeys(hashes))  # the same image twice is encoded once
        found: dict[str, Entry] = {}
        if self.cache is not None:
            for h in unique:
                entry = await self.cache.get(cache_key(h, salt))
                if entry is not None:
                    found[h] = entry
        cached = set(found)
        misses = [h for h in unique if h not in found]
        if misses:
            first = {h: hashes.index(h) for h in misses}
            items = [(first[h], images[first[h]].data, images[first[h]].mime_type) for h in misses]
            async with self._gate:
                with _ENCODE_SECONDS.time():
                    loop = asyncio.get_running_loop()
                    computed = await loop.run_in_executor(self._forward, self._compute, enc, items)
            for h, entry in zip(misses, computed, strict=True):
                found[h] = entry
                if self.cache is not None:
                    await self.cache.put(cache_key(h, salt), entry)
        out = []
        for h in hashes:
            entry = found[h]
            _IMAGES.labels("cache" if h in cached else "encoder").inc()
            t, hh, ww = entry.grid
            out.append(vision_pb2.EncodedImage(rows=to_proto(entry.rows), grid=common_pb2.Grid(t=t, h=hh, w=ww),
                                               content_hash=h, cached=h in cached))
        return vision_pb2.EncodeResponse(images=out)

    @grpc_errors
    async def GetModelInfo(self, request, context):
        enc = self._ready()
        return vision_pb2.GetModelInfoResponse(name=enc.name, encoder_revision=enc.revision,
                                               hidden_size=enc.hidden_size, recipe=enc.recipe.name,
                                               max_pixels=self.cfg.max_pixels)


def check(cfg: VisionConfig) -> None:
    """--model read before anything starts (services/common/process.py): encoder.check's refusals."""
    encoder_mod.check(cfg.model, cfg.recipe)


async def start(server_cfg: VisionServerConfig, cfg: VisionConfig) -> tuple[Server, VisionServicer]:
    """Start the server (NOT_SERVING), load the encoder off the loop, then report SERVING."""
    servicer = VisionServicer(cfg)
    server = Server(server_cfg, lambda s: vision_pb2_grpc.add_VisionServiceServicer_to_server(servicer, s),
                    [SERVICE_NAME])
    await server.start()
    try:
        await compute.in_own_thread(servicer.load)   # its OpenMP team leaves with it (services/common/compute.py)
    except BaseException:
        await server.stop(0)    # an encoder that cannot be served: unbind before the error ends the process
        raise
    if cfg.redis_url:
        servicer.cache = FeatureCache(cfg.redis_url, budget_bytes=cfg.cache_bytes, ttl_s=cfg.cache_ttl_s,
                                      prefix=cfg.cache_prefix, timeout_s=cfg.redis_timeout_s,
                                      backoff_s=cfg.redis_backoff_s, password=cfg.redis_password())
        try:
            await servicer.cache.check_credentials()
        except BaseException:
            await servicer.cache.close()
            await server.stop(0)
            raise
    log.info("serving %s (recipe %s, preprocessing %s), feature cache: %s", servicer.encoder.name,
             servicer.encoder.recipe.name, json.dumps(servicer.recipe_config), cfg.redis_url or "off")
    await server.ready()
    return server, servicer


async def launch(server_cfg: VisionServerConfig, cfg: VisionConfig) -> Started:
    """`start` for the shared process start-up (services/common/process.py): closing closes the Redis
    connection once the server has drained."""
    server, servicer = await start(server_cfg, cfg)

    async def close() -> None:
        if servicer.cache is not None:
            await servicer.cache.close()
    return Started(server, close)
