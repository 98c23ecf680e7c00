"""Request-level placement: parts <-> images, text-only models and templates that cannot place images."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from services.common.errors import InvalidArgument, Unsupported
from services.common.pb import common_pb2, decoder_pb2
from services.common.tensors import to_proto
from services.decoder.model.config import ModelConfig
from services.decoder.multimodal.request import place_images, request_images
from services.decoder.text.chat_template import ChatTemplate
from services.decoder.text.tokenizer import Tokenizer

D = decoder_pb2


def request(indices, n_images, hidden=64, grid=(1, 2, 2)):
    t, h, w = grid
    imgs = [D.ImageInput(rows=to_proto(torch.full((t * h * w, hidden), float(i))),
                         grid=common_pb2.Grid(t=t, h=h, w=w), content_hash=f"h{i}") for i in range(n_images)]
    parts = [D.ContentPart(image_index=i) for i in indices] + [D.ContentPart(text="hi")]
    return D.GenerateRequest(chat=D.ChatMessages(messages=[D.ChatMessage(role="user", content=parts)],
                                                 add_generation_prompt=True), images=imgs)


def test_images_follow_part_order(vl_ckpt):
    cfg = ModelConfig.from_folder(vl_ckpt)
    got = request_images(request([2, 0, 1], 3), cfg, model="m")
    assert [im.content_hash for im in got] == ["h2", "h0", "h1"]
    assert [float(im.rows[0, 0]) for im in got] == [2.0, 0.0, 1.0]


def test_text_only_model_refuses_image_parts_and_images(vl_ckpt):
    text_only = dataclasses.replace(ModelConfig.from_folder(vl_ckpt), vision=None)
    for req in (request([0], 1), request([0], 0), request([], 1)):
        with pytest.raises(Unsupported, match="text-only"):
            request_images(req, text_only, model="m")
    assert request_images(request([], 0), text_only, model="m") == []


def test_template_that_cannot_place_images_is_refused(vl_ckpt):
    cfg = ModelConfig.from_folder(vl_ckpt)
    tok = Tokenizer.from_folder(vl_ckpt)
    images = request_images(request([0], 1), cfg, model="m")
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    # Iterates the parts (so it receives the image part) but writes only text: the image would be lost.
    text_parts_only = ChatTemplate("{% for m in messages %}{% for p in m.content %}{% if p.type == 'text' %}"
                                   "{{ p.text }}{% endif %}{% endfor %}{% endfor %}", {})
    ids = text_parts_only.encode(tok, conv, add_generation_prompt=True)
    with pytest.raises(InvalidArgument, match="0 image placeholder"):
        place_images(ids, images, cfg)
    # A template that takes content as a string refuses image parts before rendering anything.
    string_template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", {})
    with pytest.raises(Unsupported, match="text only"):
        string_template.encode(tok, conv, add_generation_prompt=True)


def test_text_prompt_on_a_vision_model_keeps_plain_positions(vl_ckpt):
    cfg = ModelConfig.from_folder(vl_ckpt)
    placed = place_images([5, 6, 7], [], cfg)
    assert placed.token_ids == [5, 6, 7] and placed.images is None and placed.span_keys == ()
