"""Qwen2.5-VL: our vision tower + our decoder vs transformers' Qwen2_5_VLForConditionalGeneration on one tiny
random checkpoint: its config read as a qwen2 text model with M-RoPE, image positions equal to its own
get_rope_index (for images, Qwen2-VL's rule: the temporal step `second_per_grid_ts` applies to video only), the
same logits at every prompt position and the same greedy tokens, with the fast paths pinned on and pinned off
(docs/design.md, invariants 1-3)."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from services.decoder.engine.config import EngineConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.step import ScheduledChunk, StepInput
from services.decoder.model.config import ModelConfig
from services.decoder.model.loader import load_model
from services.decoder.multimodal.prompt import expand_images
from services.decoder.runner.runner import Runner
from tests.decoder.families.test_granite_olmo2 import PLANS
from tests.decoder.multimodal.conftest import photo
from tests.decoder.multimodal.helpers import (
    EOS,
    encode_images,
    greedy,
    messages,
    our_prompt,
    reference_inputs,
    run,
)
from tests.decoder.multimodal.test_model import dense_attend
from tests.decoder.multimodal.test_positions import CASES as POSITION_CASES
from tests.decoder.multimodal.test_positions import image, theirs
from tests.tolerance import assert_close
from tests.vision.checkpoints import VL_SHAPE_2_5, token_ids, write_qwen2_5_vl

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

NEW_TOKENS = 10
CASES = {
    "one_image": (messages("What is in this picture?", 1), ["rocket.jpg"]),
    "two_images_text_between": (messages("Compare them.", 2, between=" and then "), ["coffee.png", "chelsea.png"]),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_qwen2_5_vl(tmp_path_factory.mktemp("multimodal") / "tiny-qwen2.5-vl", seed=4)


@pytest.fixture(scope="module")
def reference(ckpt):
    from transformers import Qwen2_5_VLForConditionalGeneration
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prepared(ckpt):
    from services.vision import encoder as encoder_mod
    encoder = encoder_mod.load(ckpt)
    out = {}
    for name, (msgs, names) in CASES.items():
        datas = [photo(n) for n in names]
        out[name] = (our_prompt(ckpt, msgs, encode_images(encoder, datas)), reference_inputs(ckpt, msgs, datas))
    return out


def test_config_is_qwen2_text_with_mrope(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["model_type"] == "qwen2_5_vl" and raw["text_config"]["model_type"] == "qwen2_5_vl_text"
    cfg = ModelConfig.from_folder(ckpt)
    ids = token_ids()
    assert cfg.family == "qwen2" and cfg.qkv_bias and cfg.mrope_sections == (2, 3, 3)
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (64, 2, 384)
    assert cfg.vision.image_token_id == ids["<|image_pad|>"] and cfg.vision.spatial_merge_size == 2
    assert cfg.eos_token_ids == (ids["<|im_end|>"],)


def test_flat_transformers4_config_reads_the_same(ckpt):
    """Qwen2.5-VL's published config.json (transformers 4): one flat dict, rope_scaling {"type": "mrope"}."""
    nested = json.loads((ckpt / "config.json").read_text())
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    text = copy.deepcopy(nested["text_config"])
    params = text.pop("rope_parameters")
    flat.update(text, model_type="qwen2_5_vl", rope_theta=params["rope_theta"],
                rope_scaling={"type": "mrope", "mrope_section": params["mrope_section"]})
    assert ModelConfig.from_dict(flat) == ModelConfig.from_dict(nested)
    del flat["rope_scaling"]
    with pytest.raises(Exception, match="mrope_section"):
        ModelConfig.from_dict(flat)


@pytest.mark.parametrize("name", sorted(POSITION_CASES))
def test_image_positions_equal_get_rope_index(reference, ckpt, name):
    ids, grids = POSITION_CASES[name]
    cfg = ModelConfig.from_folder(ckpt)
    vp = expand_images(ids, [image(g, i) for i, g in enumerate(grids)], cfg.vision, cfg.mrope_sections)
    want_pos, want_delta = theirs(reference, vp.token_ids, grids)
    assert torch.equal(vp.positions, want_pos) and vp.delta == want_delta


@pytest.mark.parametrize("case", sorted(CASES))
def test_prompt_ids_and_logits_equal_transformers(ckpt, reference, prepared, case):
    vp, ref = prepared[case]
    assert vp.token_ids == ref.input_ids[0].tolist()
    with torch.no_grad():
        want = reference(**ref.kwargs()).logits[0]                              # [T, V]
    model = load_model(ckpt)
    with torch.no_grad():
        embeds = model.embed(torch.tensor(vp.token_ids))
        for pos, row in vp.image_rows.items():
            embeds[pos] = row
        got = model.logits(model(embeds, vp.positions, dense_attend))
    assert_close(got, want, **VL_SHAPE_2_5)
    for plan in ("fast", "reference"):
        runner = Runner.from_folder(ckpt, "fp32", block_size=4, num_blocks=64, fast_paths=PLANS[plan])
        n = len(vp.token_ids)
        chunk = ScheduledChunk("r", list(vp.token_ids), 0, list(range((n + 3) // 4)), True, greedy(1),
                               num_prompt_tokens=n, images=vp.placed())
        last, _ = runner.logits(StepInput([chunk]))
        assert_close(last[0], want[-1], **VL_SHAPE_2_5, what=plan)


@pytest.fixture(scope="module")
def expected_greedy(reference, prepared):
    out = {}
    for name, (_, ref) in prepared.items():
        with torch.no_grad():
            gen = reference.generate(**ref.kwargs(), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
        out[name] = gen[0, ref.input_ids.shape[1]:].tolist()
    return out


@pytest.mark.parametrize("plan", ["fast", "reference"])
def test_greedy_equals_transformers_generate(ckpt, prepared, expected_greedy, plan):
    """Both prompts batched in one engine, prefilled in chunks that cut through the images."""
    runner = Runner.from_folder(ckpt, "fp32", 4, 256, fast_paths=PLANS[plan])
    core = EngineCore(runner, EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=48,
                                           max_num_seqs=8, max_model_len=1024, enable_prefix_caching=True,
                                           eos_token_ids=(EOS,)))
    got = run(core, {name: vp for name, (vp, _) in prepared.items()}, greedy(NEW_TOKENS))
    for name, want in expected_greedy.items():
        assert len(want) == NEW_TOKENS and got[name].tokens == want, name
    core.check_idle()
