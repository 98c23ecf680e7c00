"""python -m services.pooling --embedding-model DIR [--reranker-model DIR] --port P"""
from __future__ import annotations

import asyncio
import logging
import sys

import torch

from services.common import allocator, compute, config, logs

from .config import PoolingConfig, PoolingServerConfig
from .server import start_server

log = logging.getLogger("tessera.pooling")


async def _serve(server_cfg: PoolingServerConfig, cfg: PoolingConfig) -> None:
    handle = await start_server(server_cfg, cfg)
    try:
        await handle.server.serve_until_signal()
    finally:
        await handle.stop(0)


def main(argv=None) -> int:
    server_cfg, cfg = config.load(
        (PoolingServerConfig, PoolingConfig), argv, prog="python -m services.pooling",
        description="tessera pooling service: embeddings and cross-encoder reranking over gRPC, "
                    "with dynamic batching")
    logs.setup(server_cfg.log_level)
    config.log_config(server_cfg, cfg)
    allocator.keep_freed_memory()    # before the model loads (services/common/allocator.py)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        # After the count, which would undo it: the loop's threads start no OpenMP teams (services/common/compute.py).
        asyncio.run(compute.serially(_serve(server_cfg, cfg)))
    except (ValueError, OSError) as exc:
        # A folder the service cannot serve faithfully: say why, exit non-zero.
        log.error("cannot start: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
