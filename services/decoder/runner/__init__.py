"""The decoder's model runner: flat step batches, paged attention on the KV cache, sampling."""
from services.decoder.runner.runner import Runner

__all__ = ["Runner"]
