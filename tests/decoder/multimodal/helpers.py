"""Shared steps of the multimodal tests: our prompt pipeline (decoder + vision code, no transformers),
transformers' reference pipeline (tokenizer, image processor, Qwen2VLForConditionalGeneration), and an
in-process engine (EngineCore + Runner) loop."""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import torch

from services.decoder.engine.config import EngineConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.step import SamplingParams
from services.decoder.model.config import ModelConfig
from services.decoder.multimodal.images import ImageInput, make_image
from services.decoder.multimodal.prompt import VisionPrompt, expand_images
from services.decoder.runner.runner import Runner
from services.decoder.text.chat_template import ChatTemplate
from services.decoder.text.tokenizer import Tokenizer
from services.vision.image import Limits, decode

LIMITS = Limits(50 * 2**20, 50_000_000)
EOS = 258


def messages(text: str, n_images: int, between: str = "") -> list[dict]:
    """One user turn: n image parts (with `between` text after each but the last), then text."""
    parts: list[dict] = []
    for i in range(n_images):
        parts.append({"type": "image"})
        if between and i < n_images - 1:
            parts.append({"type": "text", "text": between})
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def encode_images(encoder, datas: list[bytes]) -> list[ImageInput]:
    """Our vision path: decode, recipe, tower -> validated ImageInputs (rows + post-merge grid)."""
    prepared = [encoder.recipe(decode(d, LIMITS)) for d in datas]
    rows = encoder.encode(prepared)
    return [make_image(r, encoder.merged_grid(p.grid), f"hash-{i}", encoder.hidden_size, i)
            for i, (r, p) in enumerate(zip(rows, prepared, strict=True))]


def our_prompt(folder: Path, msgs: list[dict], images: list[ImageInput]) -> VisionPrompt:
    """Our decoder's prompt building: tokenizer + chat template of the folder, then expansion."""
    tok = Tokenizer.from_folder(folder)
    ids = ChatTemplate.from_folder(folder, tok).encode(tok, msgs, add_generation_prompt=True)
    cfg = ModelConfig.from_folder(folder)
    return expand_images(ids, images, cfg.vision, cfg.mrope_sections)


@dataclass
class RefInputs:
    input_ids: torch.Tensor          # [1, T]
    mm_token_type_ids: torch.Tensor  # [1, T]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None

    def kwargs(self) -> dict:
        out = dict(input_ids=self.input_ids, attention_mask=torch.ones_like(self.input_ids),
                   mm_token_type_ids=self.mm_token_type_ids)
        if self.pixel_values is not None:
            out.update(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw)
        return out


def reference_inputs(folder: Path, msgs: list[dict], datas: list[bytes]) -> RefInputs:
    """transformers' pipeline, as Qwen2VLProcessor does it (the processor class itself needs torchvision):
    apply_chat_template to text, each <|image_pad|> replaced by grid.prod() // merge**2 copies, tokenize,
    mm_token_type_ids = 1 on image tokens."""
    from PIL import Image
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    pixel_values = grid = None
    if datas:
        proc = Qwen2VLImageProcessorPil.from_pretrained(folder)
        out = proc(images=[Image.open(io.BytesIO(d)) for d in datas], return_tensors="pt")
        pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
        pieces = text.split("<|image_pad|>")
        assert len(pieces) == len(datas) + 1
        text = pieces[0]
        for g, rest in zip(grid, pieces[1:], strict=True):
            text += "<|image_pad|>" * int(g.prod() // proc.merge_size**2) + rest
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    return RefInputs(ids, (ids == image_id).int(), pixel_values, grid)


# Speculation drafts always: these tests check that drafts change no token, and the load-time gate that
# stops unprofitable drafting (tests/decoder/engine/test_draft_gate.py) could stop them on a busy machine.
PINS = "screen=on,speculation=always"


def make_core(folder: Path, *, budget: int = 512, num_blocks: int = 256, block_size: int = 4,
              prefix_caching: bool = True, max_num_seqs: int = 8, speculative=None) -> EngineCore:
    runner = Runner.from_folder(folder, "fp32", block_size, num_blocks, fast_paths=PINS)
    return EngineCore(runner, EngineConfig(block_size=block_size, num_blocks=num_blocks,
                                           max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                           max_model_len=1024, enable_prefix_caching=prefix_caching,
                                           eos_token_ids=(EOS,), speculative=speculative))


@dataclass
class Result:
    tokens: list[int]
    logprobs: list[float]
    cached: int


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def run(core: EngineCore, requests: dict[str, VisionPrompt | list[int]], sampling: SamplingParams,
        stagger: int = 0) -> dict[str, Result]:
    """Add the requests (all at once, or one every `stagger` steps) and step until all finish."""
    results = {rid: Result([], [], 0) for rid in requests}
    pending = list(requests.items())
    steps = 0
    while pending or core.has_unfinished():
        if pending and (stagger == 0 or steps % stagger == 0):
            for rid, prompt in pending[:None if stagger == 0 else 1]:
                if isinstance(prompt, VisionPrompt):
                    core.add_request(rid, prompt.token_ids, sampling, images=prompt.placed(),
                                     span_keys=prompt.span_keys())
                else:
                    core.add_request(rid, prompt, sampling)
            pending = [] if stagger == 0 else pending[1:]
        for out in core.step():
            assert out.finish_reason in (None, "length"), out
            res = results[out.request_id]
            res.tokens.extend(out.new_token_ids)
            res.logprobs.extend(t.logprob for t in out.new_tokens)
            res.cached = max(res.cached, out.num_cached_tokens)
        steps += 1
        assert steps < 5000
    return results
