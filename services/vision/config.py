"""The vision service's configuration: server, model, input limits and the Redis feature cache."""
from __future__ import annotations

from dataclasses import dataclass

from services.common import dtypes
from services.common.config import option
from services.common.server import ServerConfig

# Every variable this service reads is TESSERA_VISION_<FLAG> (services/common/config.py).
ENV_PREFIX = "TESSERA_VISION_"


@dataclass(frozen=True)
class VisionServerConfig(ServerConfig):
    """process and gRPC server options"""

    port: int = option(50051, "port to bind; 0 picks a free one")
    # A max-size Qwen2-VL image is 16384 rows x 1536 floats = 96 MiB of response.
    max_message_mb: int = option(256, "largest gRPC message accepted or sent, in MiB")


@dataclass(frozen=True)
class VisionConfig:
    """model, input limits and feature cache options"""

    model: str = option("", "checkpoint folder: a Qwen2-VL or Qwen2.5-VL HF folder (config.json, safetensors, "
                            "preprocessor_config.json) or a tessera demo vision folder", metavar="DIR")
    recipe: str = option("auto", "preprocessing + encoder recipe; auto reads config.json's model_type",
                         choices=("auto", "qwen2_vl", "qwen2_5_vl", "demo"))
    dtype: str = option("fp32", "encoder compute dtype; float32, bfloat16 and float16 are accepted too (rows "
                        "always travel as fp32)", choices=dtypes.names())
    device: str = option("cpu", "torch device: cpu or cuda")
    # This service's own bound, for any caller; behind the gateway the decoder's published limits
    # (GetModelInfo.limits, lower by default) are checked first, so the decoder's number is the one users meet.
    max_image_bytes: int = option(20 * 2**20, "largest compressed image accepted, in bytes (413 past it)")
    max_pixels: int = option(40_000_000, "largest decoded image (width*height) accepted; checked from the "
                                         "header before any pixel is decoded")
    max_images: int = option(16, "most images in one Encode call (413 past it)")
    max_pending: int = option(64, "Encode calls allowed to wait for the encoder before RESOURCE_EXHAUSTED")
    redis_url: str = option("", "Redis URL of the feature cache (redis://host:port/db); empty disables it")
    cache_bytes: int = option(256 * 2**20, "byte budget of cached rows in Redis; least recently used "
                                           "entries are evicted past it")
    cache_ttl_s: int = option(3600, "seconds a cached entry lives after its last use")
    cache_prefix: str = option("tessera:vision", "Redis key prefix (one prefix per encoder deployment)")
    redis_timeout_s: float = option(0.25, "Redis connect and socket timeout; a slow Redis is treated as down")
    redis_backoff_s: float = option(2.0, "after a Redis error, skip the cache for this long before trying again")

    def __post_init__(self):
        if not self.model:
            raise ValueError("--model DIR is required")
        object.__setattr__(self, "dtype", dtypes.canonical(self.dtype))   # one spelling from here on
        for name in ("max_image_bytes", "max_pixels", "max_images", "max_pending", "cache_bytes", "cache_ttl_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.redis_timeout_s <= 0 or self.redis_backoff_s < 0:
            raise ValueError("redis_timeout_s must be positive and redis_backoff_s >= 0")
