"""python -m services.pooling --embedding-model DIR [--reranker-model DIR] --port P"""
from __future__ import annotations

import sys

from services.common.process import Service, main

from .config import ENV_PREFIX, PoolingConfig, PoolingServerConfig
from .folder import check
from .server import launch

SERVICE = Service(
    prog="python -m services.pooling", env_prefix=ENV_PREFIX, server_config=PoolingServerConfig,
    config=PoolingConfig, start=launch, check=check,
    description="tessera pooling service: embeddings and cross-encoder reranking over gRPC, with dynamic batching")

if __name__ == "__main__":
    sys.exit(main(SERVICE))
