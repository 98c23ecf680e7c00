"""Images through the engine: chunk boundaries inside an image, prefix-cache salts, preemption
(docs/design.md, invariants 3, 4).

Every expected output here comes from the same engine run without the constraint under test; the
unconstrained engine itself equals transformers' generate (test_model.py).
"""
from __future__ import annotations

import io

import pytest
from PIL import Image

from services.decoder.engine.hashing import extend_block_hashes
from services.decoder.engine.request import Request
from tests.decoder.model.checkpoints import TINY_SHAPE
from tests.decoder.multimodal.conftest import photo
from tests.decoder.multimodal.helpers import encode_images, greedy, make_core, messages, our_prompt, run
from tests.tolerance import assert_close

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

BLOCK = 4
NEW = 8
TEXT = "What is in this picture?"


def mirrored(data: bytes) -> bytes:
    """The same photo flipped left-right: the same size (so the same grid and placeholders), other pixels."""
    out = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def prompts(vl_ckpt, encoder):
    cat = photo("chelsea.png")
    datas = {"cat": cat, "mirror": mirrored(cat), "astronaut": photo("astronaut.png")}
    return {name: our_prompt(vl_ckpt, messages(TEXT, 1), encode_images(encoder, [d])) for name, d in datas.items()}


@pytest.fixture(scope="module")
def solo(vl_ckpt, prompts):
    """Each prompt alone in a fresh engine, in one prefill chunk."""
    return {name: run(make_core(vl_ckpt, block_size=BLOCK), {name: vp}, greedy(NEW))[name]
            for name, vp in prompts.items()}


def assert_same(a, b):
    assert a.tokens == b.tokens
    # The same image rows on both sides: only the text model's order of work differs.
    assert_close(a.logprobs, b.logprobs, **TINY_SHAPE)


def test_chunk_boundaries_inside_an_image_give_the_same_output(vl_ckpt, prompts, solo):
    budget = 16
    (start, end), = prompts["cat"].spans
    cuts = [c for c in range(budget, len(prompts["cat"].token_ids), budget) if start < c < end]
    assert len(cuts) >= 2, "the test needs chunk boundaries that cut through the image"
    core = make_core(vl_ckpt, budget=budget, block_size=BLOCK, prefix_caching=False)
    got = run(core, {"cat": prompts["cat"]}, greedy(NEW))["cat"]
    assert_same(got, solo["cat"])
    core.check_idle()


def test_same_placeholders_different_images_share_no_kv(vl_ckpt, prompts, solo):
    cat, mirror = prompts["cat"], prompts["mirror"]
    assert cat.token_ids == mirror.token_ids                  # identical placeholder ids ...
    assert cat.images[0].content_hash == mirror.images[0].content_hash   # ... and even the same claimed hash
    (start, _), = cat.spans
    first_image_block = start // BLOCK
    hashes = {}
    for name, vp in (("cat", cat), ("mirror", mirror)):
        req = Request(name, vp.token_ids, greedy(NEW), arrival_seq=0, span_keys=vp.span_keys())
        hashes[name] = extend_block_hashes(req, BLOCK)
    # Text blocks before the image stay shared; from the first image block on, nothing is.
    assert hashes["cat"][:first_image_block] == hashes["mirror"][:first_image_block]
    assert not set(hashes["cat"][first_image_block:]) & set(hashes["mirror"][first_image_block:])

    core = make_core(vl_ckpt, block_size=BLOCK)
    first = run(core, {"cat": cat}, greedy(NEW))["cat"]
    second = run(core, {"mirror": mirror}, greedy(NEW))["mirror"]
    assert first_image_block * BLOCK >= second.cached > 0      # a text-prefix hit, stopping before the image
    assert_same(first, solo["cat"])
    assert_same(second, solo["mirror"])
    # Different images, different answers (logprobs; greedy tokens of a random model may still agree).
    assert max(abs(a - b) for a, b in zip(first.logprobs, second.logprobs, strict=True)) > 1e-3
    core.check_idle()


def test_same_image_and_prompt_twice_hits_past_the_image(vl_ckpt, prompts, solo):
    core = make_core(vl_ckpt, block_size=BLOCK)
    first = run(core, {"a": prompts["cat"]}, greedy(NEW))["a"]
    again = run(core, {"b": prompts["cat"]}, greedy(NEW))["b"]
    (_, end), = prompts["cat"].spans
    assert first.cached == 0 and again.cached >= end
    assert_same(first, solo["cat"])
    assert_same(again, solo["cat"])
    core.check_idle()


def test_preemption_with_images_gives_the_same_output(vl_ckpt, prompts, solo):
    """A pool too small for all three image requests: the latest arrivals are preempted, their KV dropped,
    and recomputed later from the same saved rows, in chunks that cut through their images."""
    core = make_core(vl_ckpt, budget=48, num_blocks=60, block_size=BLOCK, prefix_caching=False)
    got = run(core, dict(prompts), greedy(NEW), stagger=2)
    assert core.stats().num_preemptions > 0
    for name in prompts:
        assert_same(got[name], solo[name])
    core.check_idle()


def test_speculation_with_images_gives_the_same_output(vl_ckpt, prompts):
    """Drafts after an image prompt: verified at M-RoPE text positions (physical + delta), in one batch
    with the other image requests; the tokens equal the run without speculation."""
    from services.decoder.engine.config import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1,
                             disable_by_batch_size=8)
    plain = run(make_core(vl_ckpt, block_size=BLOCK), dict(prompts), greedy(24))
    core = make_core(vl_ckpt, block_size=BLOCK, speculative=spec)
    got = run(core, dict(prompts), greedy(24))
    assert core.stats().num_accepted_tokens > 0, core.stats()
    for name in prompts:
        assert_same(got[name], plain[name])
    core.check_idle()
