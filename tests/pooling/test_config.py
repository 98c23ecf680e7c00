"""CLI, config validation and folder reading (what a folder declares wins; what we cannot honour is refused)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from services.common.config import load
from services.pooling.config import ENV_PREFIX, PoolingConfig, PoolingServerConfig
from services.pooling.folder import read_spec

FLAGS = ("--embedding-model", "--embedding-name", "--reranker-model", "--reranker-name", "--pooling",
         "--normalize", "--max-model-len", "--max-request-inputs", "--max-batch-size", "--max-batch-tokens",
         "--max-wait-ms", "--max-queue", "--max-passes", "--threads", "--dtype", "--packed", "--port", "--metrics-port",
         "--fault-fail-at-forward")


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "services.pooling", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in FLAGS:
        assert flag in out, flag
    assert "50053" in out


def test_config_defaults_and_validation():
    server, cfg = load((PoolingServerConfig, PoolingConfig), ["--embedding-model", "x"], prog="t",
                       description="t", env_prefix=ENV_PREFIX, environ={})
    assert server.port == 50053 and cfg.max_batch_size == 64
    assert (cfg.max_passes, cfg.fault_fail_at_forward) == (2, 0)
    for argv in ([], ["--embedding-model", "x", "--max-queue", "4", "--max-request-inputs", "8"],
                 ["--embedding-model", "x", "--max-batch-size", "0"], ["--embedding-model", "x", "--max-passes", "-1"],
                 ["--embedding-model", "x", "--fault-fail-at-forward", "-1"]):
        with pytest.raises(SystemExit):
            load((PoolingServerConfig, PoolingConfig), argv, prog="t", description="t", env_prefix=ENV_PREFIX,
                 environ={})


def test_folder_declarations(minilm_dir, tiny_bert_dir, tiny_llama_dir, tiny_reranker_dir):
    spec = read_spec(minilm_dir, kind="embedding")       # legacy pooling_mode_* keys + Normalize
    assert (spec.pooling, spec.normalize, spec.max_model_len, spec.matryoshka) == ("mean", True, 256, ())
    with pytest.raises(ValueError, match="declares mean pooling"):
        read_spec(minilm_dir, kind="embedding", pooling="cls")
    with pytest.raises(ValueError, match="declares normalize=True"):
        read_spec(minilm_dir, kind="embedding", normalize=False)
    assert read_spec(tiny_bert_dir, kind="embedding", pooling="last", normalize=True).pooling == "last"
    assert read_spec(tiny_llama_dir, kind="embedding").pooling == "last"
    with pytest.raises(ValueError, match="cross-encoder"):
        read_spec(tiny_reranker_dir, kind="embedding")
    with pytest.raises(ValueError, match="ForSequenceClassification"):
        read_spec(tiny_bert_dir, kind="rerank")


def test_unsupported_declarations_are_refused(tmp_path, tiny_st_dir, tiny_reranker_dir):
    dense = tmp_path / "dense"
    shutil.copytree(tiny_st_dir, dense)
    modules = json.loads((dense / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (dense / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        read_spec(dense, kind="embedding")
    custom = tmp_path / "custom"
    shutil.copytree(tiny_reranker_dir, custom)
    cfg = json.loads((custom / "config.json").read_text())
    cfg["sentence_transformers"] = {"activation_fn": "mypkg.Weird"}
    (custom / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="activation"):
        read_spec(custom, kind="rerank")
    cfg["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (custom / "config.json").write_text(json.dumps(cfg))
    assert read_spec(custom, kind="rerank").activation == "identity"
