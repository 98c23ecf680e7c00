"""The pooling service's Prometheus metrics, in a registry of its own per service instance,
so that several services started in one process (tests) never collide."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram

from services.common.metrics import LATENCY_BUCKETS

_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)


class PoolingMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.queue_depth = Gauge("tessera_pooling_queue_depth", "sequences waiting for a forward",
                                 ["model"], registry=self.registry)
        self.batch_size = Histogram("tessera_pooling_batch_size", "sequences per forward", ["model"],
                                    buckets=_SIZE_BUCKETS, registry=self.registry)
        self.batch_tokens = Histogram("tessera_pooling_batch_tokens", "real tokens per forward",
                                      ["model"], buckets=_TOKEN_BUCKETS, registry=self.registry)
        # The two stages of a request's latency that batching adds: its wait in the queue (hold
        # timer and earlier forwards) and the forward it ran in.
        self.queue_seconds = Histogram("tessera_pooling_queue_seconds", "time a sequence waited for its forward",
                                       ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.forward_seconds = Histogram("tessera_pooling_forward_seconds", "duration of one forward",
                                         ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.latency = Histogram("tessera_pooling_request_seconds", "request latency", ["rpc", "code"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
