"""`python -m services.vision --model DIR [--redis-url URL] --port P`: images -> decoder rows over gRPC."""
from __future__ import annotations

import asyncio

from services.common import allocator, compute, logs, metrics
from services.common import config as cfg_mod
from services.vision.config import VisionConfig, VisionServerConfig
from services.vision.service import serve


def main(argv=None) -> None:
    server_cfg, vision_cfg = cfg_mod.load(
        (VisionServerConfig, VisionConfig), argv, prog="python -m services.vision",
        description="tessera vision: PNG/JPEG/WebP/GIF bytes -> projected decoder rows, grid and content hash "
                    "(Qwen2-VL vision tower or the demo ViT), with a bounded Redis feature cache "
                    "(tessera.vision.v1).")
    logs.setup(server_cfg.log_level)
    cfg_mod.log_config(server_cfg, vision_cfg)
    metrics.serve(server_cfg.metrics_port)
    allocator.keep_freed_memory()    # before the model loads (services/common/allocator.py)
    # The loop's threads start no OpenMP teams of their own (services/common/compute.py).
    asyncio.run(compute.serially(serve(server_cfg, vision_cfg)))


if __name__ == "__main__":
    main()
