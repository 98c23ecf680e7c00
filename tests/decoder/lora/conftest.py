"""Fixtures shared with the decoder service tests (the tiny chat model with SmolLM2's tokenizer)."""
from tests.decoder.server.conftest import tiny_chat_model  # noqa: F401  (re-exported fixture)
