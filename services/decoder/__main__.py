"""`python -m services.decoder --model DIR --port P`: the generation engine over gRPC."""
from __future__ import annotations

import asyncio

from services.common import allocator, compute, logs, metrics
from services.common import config as cfg_mod
from services.decoder.server.config import DecoderConfig, DecoderServerConfig
from services.decoder.server.service import serve


def main(argv=None) -> None:
    server_cfg, decoder_cfg = cfg_mod.load(
        (DecoderServerConfig, DecoderConfig), argv, prog="python -m services.decoder",
        description="tessera decoder: paged KV cache, continuous batching, chunked prefill, prefix "
                    "caching and preemption, streaming tokens over gRPC (tessera.decoder.v1).")
    logs.setup(server_cfg.log_level)
    cfg_mod.log_config(server_cfg, decoder_cfg)
    metrics.serve(server_cfg.metrics_port)
    allocator.keep_freed_memory()    # before the model loads (services/common/allocator.py)
    # The loop's threads start no OpenMP teams of their own (services/common/compute.py).
    asyncio.run(compute.serially(serve(server_cfg, decoder_cfg)))


if __name__ == "__main__":
    main()
