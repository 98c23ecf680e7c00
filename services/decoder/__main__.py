"""`python -m services.decoder --model DIR --port P`: the generation engine over gRPC."""
from __future__ import annotations

import sys

from services.common.process import Service, main
from services.decoder.server.config import ENV_PREFIX, DecoderConfig, DecoderServerConfig
from services.decoder.server.service import check, launch

SERVICE = Service(
    prog="python -m services.decoder", env_prefix=ENV_PREFIX, server_config=DecoderServerConfig,
    config=DecoderConfig, start=launch, check=check,
    description="tessera decoder: paged KV cache, continuous batching, chunked prefill, prefix caching and "
                "preemption, streaming tokens over gRPC (tessera.decoder.v1).")

if __name__ == "__main__":
    sys.exit(main(SERVICE))
