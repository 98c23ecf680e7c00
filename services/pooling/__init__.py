"""The pooling service: embeddings and cross-encoder reranking with dynamic batching."""
