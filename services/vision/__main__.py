"""`python -m services.vision --model DIR [--redis-url URL] --port P`: images -> decoder rows over gRPC."""
from __future__ import annotations

import sys

from services.common.process import Service, main
from services.vision.config import ENV_PREFIX, VisionConfig, VisionServerConfig
from services.vision.service import check, launch

SERVICE = Service(
    prog="python -m services.vision", env_prefix=ENV_PREFIX, server_config=VisionServerConfig,
    config=VisionConfig, start=launch, check=check,
    description="tessera vision: PNG/JPEG/WebP/GIF bytes -> projected decoder rows, grid and content hash "
                "(Qwen2-VL or Qwen2.5-VL vision tower, or the demo ViT), with a bounded Redis feature cache "
                "(tessera.vision.v1).")

if __name__ == "__main__":
    sys.exit(main(SERVICE))
