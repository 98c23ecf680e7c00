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

# Every format a GGUF file maps to: 4-bit g32 (Q4_K), 8-bit g32 (Q8_0, Q5_K), 8-bit g16 (Q6_K). Q, K and V in three
# formats are fused in the finest (8-bit g16, exactly: linear.common_format), as Q4_K_M's Q4_K q and k beside its
# Q6_K v are; "stack" keeps them one format.
MIXES = {"mixed": {"attn_q": T.Q4_K, "attn_k": T.Q8_0, "attn_v": T.Q6_K, "attn_output": T.Q5_K, "ffn_gate": T.Q4_K,
                   "ffn_up": T.Q4_K, "ffn_down": T.Q6_K, "output": T.Q6_K, "token_embd": T.Q8_0},
         "stack": {"attn_output": T.Q5_K, "ffn_down": T.Q6_K, "output": T.Q6_K, "token_embd": T.Q8_0}}
FAST = "gemv=on,grouped_matmul=int4pack,glue=cpp,attention=cpp,screen=on"
PINS = {"fast": FAST, "stack": FAST + ",decode_stack=on",
        "reference": "linear=plain,gemv=off,grouped_matmul=dequant,glue=torch,attention=torch,decode_stack=off,"
                     "screen=off,huge_pages=off"}


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-engine")
    return {name: with_random_blocks(root / f"{name}.gguf", "qwen2", mix, seed=17) for name, mix in MIXES.items()}


@pytest.mark.parametrize("plan", list(PINS))
def test_grouped_paths_match_transformers(model_files, plan):
    model_file = model_files["stack" if plan == "stack" else "mixed"]
    runner = Runner.from_folder(model_file, "fp32", BLOCK, 64, fast_paths=PINS[plan])
    # What GetModelInfo reports: the file's formats, after q|k|v and gate|up were fused where they share one.
    want = {"mixed": "gguf: 9 linears grouped (2 int4/g32, 5 int8/g16, 2 int8/g32)",
            "stack": "gguf: 9 linears grouped (4 int4/g32, 3 int8/g16, 2 int8/g32)"}
    assert runner.quantization == want["stack" if plan == "stack" else "mixed"]
    ref = reference(model_file)
    ref.load_state_dict(effective_weights(load_model(model_file, "fp32")))   # unfused: transformers' names
    rows, tokens = chunked_logits(runner, PROMPTS[4], 3)
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0, len(PROMPTS[4]) - 1:]
    dtype = torch.float32 if plan == "reference" else torch.int8
    for i, got in enumerate(rows):
        assert_close(got, want[i], dtype=dtype, **K_TINY, what=f"{plan} row {i}")
    drive(engine(runner, num_blocks=64, budget=5), PROMPTS[:2], GREEDY)
