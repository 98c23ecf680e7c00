"""Structured outputs beside images: a constrained image request and a constrained text request in one batch,
with prefill chunks cutting through the image, give the outputs each gets alone, and both follow their
grammars (the tiny Qwen2-VL checkpoint's byte-level tokenizer)."""
from __future__ import annotations

import re

import pytest

from services.decoder.engine.step import SamplingParams
from services.decoder.grammar.compiler import GrammarCompiler
from services.decoder.grammar.spec import GrammarSpec
from services.decoder.model.config import ModelConfig
from services.decoder.text.tokenizer import Tokenizer
from tests.decoder.multimodal.conftest import photo
from tests.decoder.multimodal.helpers import EOS, encode_images, make_core, messages, our_prompt

REGEX = r"(cat|dog|bird) [a-z]{2,5}"


@pytest.fixture(scope="module")
def grammar(vl_ckpt):
    tok = Tokenizer.from_folder(vl_ckpt)
    compiler = GrammarCompiler(tok.backend, vocab_size=ModelConfig.from_folder(vl_ckpt).vocab_size,
                               stop_token_ids=(EOS,), special_token_ids=tok.all_special_ids)
    yield compiler.compile_now(GrammarSpec.regex(REGEX))
    compiler.close()


def generate(core, jobs: dict, grammar) -> dict:
    out = {rid: [] for rid in jobs}
    for rid, (prompt, images, span_keys) in jobs.items():
        core.add_request(rid, prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=30), images=images,
                         grammar=grammar, span_keys=span_keys)
    for _ in range(2000):
        if not core.has_unfinished():
            break
        for o in core.step():
            assert o.finish_reason in (None, "stop"), o
            out[o.request_id].extend(t for t in o.new_token_ids if t != o.stop_token_id)
    core.check_idle()
    return out


def test_constrained_image_and_text_requests_in_one_batch(vl_ckpt, encoder, grammar):
    vp = our_prompt(vl_ckpt, messages("What animal is this?", 1), encode_images(encoder, [photo("chelsea.png")]))
    text = our_prompt(vl_ckpt, messages("Name an animal.", 0), [])
    jobs = {"image": (vp.token_ids, vp.placed(), vp.span_keys()), "text": (text.token_ids, None, ())}
    solo = {rid: generate(make_core(vl_ckpt), {rid: job}, grammar)[rid] for rid, job in jobs.items()}
    (start, end), = vp.spans
    together = generate(make_core(vl_ckpt, budget=16, prefix_caching=False), jobs, grammar)   # chunks cut the image
    assert together == solo
    tok = Tokenizer.from_folder(vl_ckpt)
    for tokens in together.values():
        assert re.fullmatch(REGEX, tok.decode(tokens)), tok.decode(tokens)
    assert end - start > 16
