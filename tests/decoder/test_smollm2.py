"""The real SmolLM2-135M-Instruct (from `make models`): greedy chat output equals transformers'."""
from __future__ import annotations

import pytest
import torch

from services.decoder.engine.config import EngineConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.step import SamplingParams
from services.decoder.runner.runner import Runner
from services.decoder.text.chat_template import ChatTemplate
from services.decoder.text.tokenizer import Tokenizer
from tests.decoder.server.conftest import need_smollm2

QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write a haiku about the sea."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2():
    return need_smollm2()


def test_greedy_chat_equals_transformers(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = Tokenizer.from_folder(smollm2)
    template = ChatTemplate.from_folder(smollm2, tok)
    prompts = [template.encode(tok, [{"role": "user", "content": q}], add_generation_prompt=True)
               for q in QUESTIONS]
    hf_tok = AutoTokenizer.from_pretrained(smollm2)
    for q, p in zip(QUESTIONS, prompts, strict=True):
        ref = hf_tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        assert p == list(ref)

    runner = Runner.from_folder(smollm2, "fp32", 16, 128, fast_paths="screen=on")
    core = EngineCore(runner, EngineConfig(block_size=16, num_blocks=128, max_num_batched_tokens=256,
                                           max_model_len=2048, eos_token_ids=tok.stop_token_ids))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, greedy)
    got = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished():
        for out in core.step():
            got[out.request_id].extend(out.new_token_ids)

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False)[0, len(p):].tolist()
        assert got[str(i)] == ref, (QUESTIONS[i], tok.decode(got[str(i)]), tok.decode(ref))
    assert "Paris" in tok.decode(got["0"])
