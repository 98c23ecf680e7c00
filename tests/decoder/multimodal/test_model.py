"""Our vision encoder + our decoder vs transformers' Qwen2VLForConditionalGeneration on one random checkpoint:
the same prompt ids, the same logits at every position, the same greedy tokens (docs/design.md, invariants 1-3)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.decoder.engine.step import ScheduledChunk, StepInput
from services.decoder.model.loader import load_model
from services.decoder.runner.runner import Runner
from tests.decoder.multimodal.conftest import photo
from tests.decoder.multimodal.helpers import (
    encode_images,
    greedy,
    make_core,
    messages,
    our_prompt,
    reference_inputs,
    run,
)
from tests.tolerance import assert_close
from tests.vision.checkpoints import VL_SHAPE

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

NEW_TOKENS = 10
CASES = {
    "one_image": (messages("What is in this picture?", 1), ["chelsea.png"]),
    "two_images_text_between": (messages("Compare them.", 2, between=" and then "), ["coffee.png", "rocket.jpg"]),
}


@pytest.fixture(scope="module")
def prepared(vl_ckpt, encoder):
    out = {}
    for name, (msgs, names) in CASES.items():
        datas = [photo(n) for n in names]
        out[name] = (our_prompt(vl_ckpt, msgs, encode_images(encoder, datas)), reference_inputs(vl_ckpt, msgs, datas))
    return out


def dense_attend(layer, q, k, v):
    """Plain causal attention over the whole prompt (no KV cache): q [T, H, D], k/v [T, KV, D]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_prompt_ids_and_logits_equal_transformers(vl_ckpt, reference, prepared, case):
    vp, ref = prepared[case]
    assert vp.token_ids == ref.input_ids[0].tolist()
    with torch.no_grad():
        want = reference(**ref.kwargs()).logits[0]                              # [T, V]
    model = load_model(vl_ckpt)
    with torch.no_grad():
        embeds = model.embed(torch.tensor(vp.token_ids))
        for pos, row in vp.image_rows.items():
            embeds[pos] = row
        got = model.logits(model(embeds, vp.positions, dense_attend))
    assert_close(got, want, **VL_SHAPE)
    # The same prompt through the paged runner in one chunk: its sampled (last) row.
    runner = Runner.from_folder(vl_ckpt, "fp32", block_size=4, num_blocks=64, fast_paths="screen=on")
    n = len(vp.token_ids)
    chunk = ScheduledChunk("r", list(vp.token_ids), 0, list(range((n + 3) // 4)), True, greedy(1),
                           num_prompt_tokens=n, images=vp.placed())
    last, _ = runner.logits(StepInput([chunk]))
    assert_close(last[0], want[-1], **VL_SHAPE)


@pytest.fixture(scope="module")
def expected_greedy(reference, prepared):
    out = {}
    for name, (_, ref) in prepared.items():
        with torch.no_grad():
            gen = reference.generate(**ref.kwargs(), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
        out[name] = gen[0, ref.input_ids.shape[1]:].tolist()
    return out


def test_greedy_equals_transformers_generate(vl_ckpt, prepared, expected_greedy):
    """Both prompts batched in one engine (rows of two requests in one step), EngineCore + Runner."""
    core = make_core(vl_ckpt)
    got = run(core, {name: vp for name, (vp, _) in prepared.items()}, greedy(NEW_TOKENS))
    for name, want in expected_greedy.items():
        assert len(want) == NEW_TOKENS and got[name].tokens == want, name
    core.check_idle()
