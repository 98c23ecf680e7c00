"""Configuration of the pooling service: server options plus models and batching."""
from __future__ import annotations

from dataclasses import dataclass

from services.common import dtypes
from services.common import plan as plan_mod
from services.common.config import option
from services.common.server import ServerConfig

# Every variable this service reads is TESSERA_POOLING_<FLAG> (services/common/config.py).
ENV_PREFIX = "TESSERA_POOLING_"
# The pooling forward runs in fp32 or bf16 (no fp16 path).
DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class PoolingServerConfig(ServerConfig):
    """process and gRPC server options"""

    port: int = option(50053, "port to bind; 0 picks a free one")


@dataclass(frozen=True)
class PoolingConfig:
    """models and dynamic batching"""

    embedding_model: str = option("", "embedding model folder (HF or sentence-transformers: config.json, "
                                  "*.safetensors, tokenizer.json)", metavar="DIR")
    embedding_name: str = option("", "name clients use for the embedding model; default: folder name")
    reranker_model: str = option("", "cross-encoder folder (*ForSequenceClassification, one label); "
                                 "empty serves no reranker", metavar="DIR")
    reranker_name: str = option("", "name clients use for the reranker; default: folder name")
    pooling: str = option("", "pooling when the folder declares none: mean | cls | last "
                          "(default: last for decoders, mean otherwise)", choices=("", "mean", "cls", "last"))
    normalize: bool | None = option(None, "unit-normalise embeddings when the folder declares nothing "
                                    "(sentence-transformers files win; default off)")
    max_model_len: int = option(0, "longest input in tokens; 0 = the folder's limit")
    max_request_inputs: int = option(256, "most inputs (or documents) in one request")
    max_batch_size: int = option(64, "most sequences per forward; 1 turns dynamic batching off")
    max_batch_tokens: int = option(16384, "padded tokens (rows x longest) per forward")
    max_wait_ms: float = option(2.0, "how long a sequence may wait for others to share its forward")
    max_queue: int = option(2048, "sequences waiting per model; beyond it calls get RESOURCE_EXHAUSTED")
    max_passes: int = option(2, "forwards that may start without a waiting sequence (for neighbours closer in "
                             "length to the oldest) before it goes in arrival order; bounds every wait "
                             "(services/pooling/batcher.py); 0 is strict FIFO")
    heap_growth_mb: int = option(256, "return the C heap's free pages (malloc_trim) whenever the resident size has "
                                      "grown this many MiB since the last trim (services/pooling/heap.py); 0 never")
    dtype: str = option("fp32", "weights and activations dtype; float32 and bfloat16 are accepted too",
                        choices=dtypes.names(DTYPES))
    matmul_precision: str = option("highest", dtypes.MATMUL_PRECISION_HELP + "; the packed forward's",
                                   choices=dtypes.MATMUL_PRECISIONS)
    packed: bool = option(True, "use the packed (padding-free) BERT forward where the architecture allows")
    fast_paths: str = option("", plan_mod.help_for(plan_mod.POOLING), metavar="NAME=PATH,...")
    fault_fail_at_forward: int = option(0, "TESTING ONLY: make forward N on the device raise, as a failure of the "
                                           "forward worker (its batch fails INTERNAL, waiting calls UNAVAILABLE, "
                                           "health goes NOT_SERVING); 0 disables")

    def __post_init__(self):
        plan_mod.Pins.parse(self.fast_paths, plan_mod.POOLING)   # a bad pin is a usage error at start
        if not self.embedding_model:
            raise ValueError("--embedding-model is required")
        object.__setattr__(self, "dtype", dtypes.canonical(self.dtype, DTYPES))   # one spelling from here on
        for name in ("max_request_inputs", "max_batch_size", "max_batch_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_queue < self.max_request_inputs:
            raise ValueError("max_queue must be at least max_request_inputs, or a full request could never run")
        for name in ("max_wait_ms", "max_model_len", "max_passes", "heap_growth_mb",
                     "fault_fail_at_forward"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
