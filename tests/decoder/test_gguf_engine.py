"""The engine over a GGUF file's grouped weights (4- and 8-bit codes, groups of 32 and 16: a Q4_K_M mix plus
Q8_0, Q5_K), with the grouped fast paths pinned on and off: prefill on the many-row path, decode steps on the
few-row kernel (x rounded to int8 per group when it runs: int8's bound), against transformers over the weights
the grouped format computes with; then the engine runs requests to their length."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from services.decoder.model import load_model
from services.decoder.runner.runner import Runner
from tests.decoder.drive import drive
from tests.decoder.families.test_features import BLOCK, GREEDY, PROMPTS, chunked_logits, engine
from tests.decoder.model.gguf_checkpoints import with_random_blocks
from tests.decoder.model.test_gguf import K_TINY, effective_weights, reference
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics

MIX = {"attn_q": T.Q4_K, "attn_k": T.Q8_0, "attn_v": T.Q6_K, "attn_output": T.Q5_K, "ffn_gate": T.Q4_K,
       "ffn_up": T.Q4_K, "ffn_down": T.Q6_K, "output": T.Q6_K, "token_embd": T.Q8_0}
PINS = {"fast": "gemv=on,grouped_matmul=int4pack,glue=cpp,attention=cpp,screen=on",
        "reference": "linear=plain,gemv=off,grouped_matmul=dequant,glue=torch,attention=torch,decode_stack=off,"
                     "screen=off,huge_pages=off"}


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return with_random_blocks(tmp_path_factory.mktemp("gguf-engine") / "mix.gguf", "qwen2", MIX, seed=17)


@pytest.mark.parametrize("plan", list(PINS))
def test_grouped_paths_match_transformers(model_file, plan):
    runner = Runner.from_folder(model_file, "fp32", BLOCK, 64, fast_paths=PINS[plan])
    ref = reference(model_file)
    ref.load_state_dict(effective_weights(load_model(model_file, "fp32")))   # unfused: transformers' names
    rows, tokens = chunked_logits(runner, PROMPTS[4], 3)
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0, len(PROMPTS[4]) - 1:]
    dtype = torch.int8 if plan == "fast" else torch.float32
    for i, got in enumerate(rows):
        assert_close(got, want[i], dtype=dtype, **K_TINY, what=f"{plan} row {i}")
    drive(engine(runner, num_blocks=64, budget=5), PROMPTS[:2], GREEDY)
