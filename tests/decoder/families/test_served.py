"""Granite and OLMo 2 through a real decoder process: `python -m services.decoder` on an ephemeral port over a
tiny checkpoint (tests/decoder/model/checkpoints.py, with the character tokenizer of tokenizer.py), driven
over gRPC.

Concurrent greedy streams, token-id prompts and a text prompt, cut into chunks by a small token budget and
sped by n-gram speculation, equal transformers' greedy generate; a LoRA adapter loaded with --lora, beside
base-model streams, equals peft's; a JSON-schema request parses and matches;
GetModelInfo's execution plan says which fast paths the family does not run, and why.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
import torch

from services.common.pb import decoder_pb2, decoder_pb2_grpc
from tests.conftest import free_port
from tests.decoder.families.tokenizer import char_tokenizer, write_char_tokenizer
from tests.decoder.idle import wait_idle
from tests.decoder.lora.adapters import Spec, peft_mixed, write_adapter
from tests.decoder.model.checkpoints import build, greedy_reference
from tests.gateway.fleet import python_module, stop, wait_serving

D = decoder_pb2
DECODER = "tessera.decoder.v1.DecoderService"
CASES = {"granite": "granite_gqa2_multipliers", "olmo2": "olmo2_gqa4_postnorm"}
REFUSED = {"granite": {"decode_stack": "granite's embedding, residual and attention multipliers",
                       "screen": "granite divides the logits by logits_scaling"},
           "olmo2": {"decode_stack": "olmo2's post-norm blocks"}}
MAX_TOKENS = 10
ADAPTER = Spec("every-projection", 4, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"), 5)
PROMPTS = [[5, 9, 14, 3, 77, 21, 8] * 2, [40, 41] * 4, list(range(10, 33)), [99, 3, 150, 12, 64, 99, 3]]
TEXT = "Tell me the numbers: 1, 2, 3"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "c": {"enum": ["red", "blue"]}}, "required": ["n", "c"]}


@pytest.fixture(scope="module", params=list(CASES))
def served(request, tmp_path_factory):
    """(family, checkpoint folder, adapter folder, stub) of a decoder process serving the family's tiny checkpoint."""
    family = request.param
    root = tmp_path_factory.mktemp(f"served_{family}")
    folder = write_char_tokenizer(build(root, CASES[family], seed=3))
    adapter = write_adapter(folder, root / "adapters", ADAPTER)
    port = free_port()
    proc = python_module("services.decoder", [
        "--model", str(folder), "--host", "127.0.0.1", "--port", str(port), "--num-blocks", "128",
        "--block-size", "4", "--max-num-batched-tokens", "8", "--max-model-len", "128", "--threads", "1",
        "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                                            "disable_by_batch_size": 16}),
        # Drafts always: the test checks they change no token; the gate is tests/decoder/engine/test_draft_gate.py.
        "--fast-paths", "speculation=always",
        "--lora", f"{ADAPTER.name}={adapter}"], root / "decoder.log")
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, DECODER, proc)
        with grpc.insecure_channel(address) as channel:
            yield family, folder, adapter, decoder_pb2_grpc.DecoderServiceStub(channel)
    finally:
        stop(proc)
    assert proc.returncode == 0, (root / "decoder.log").read_text()[-2000:]


def generate(stub, request: D.GenerateRequest) -> tuple[list[int], int]:
    """One choice's streamed token ids and its finish reason."""
    tokens, finish = [], D.FINISH_REASON_UNSPECIFIED
    for reply in stub.Generate(request, timeout=120):
        tokens.extend(reply.token_ids)
        finish = reply.finish_reason or finish
    return tokens, finish


def greedy(prompt: list[int] | str) -> D.GenerateRequest:
    sampling = D.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    if isinstance(prompt, str):
        return D.GenerateRequest(text=prompt, sampling=sampling)
    return D.GenerateRequest(token_ids=D.TokenIds(ids=prompt), sampling=sampling)


def test_concurrent_greedy_streams_equal_transformers(served):
    family, folder, _, stub = served
    text_ids = char_tokenizer().encode(TEXT).ids
    expected = greedy_reference(folder, PROMPTS + [text_ids], MAX_TOKENS)
    with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
        got = list(pool.map(lambda p: generate(stub, greedy(p)), PROMPTS + [TEXT]))
    assert got == [(want, D.FINISH_REASON_LENGTH) for want in expected]
    stats = stub.GetModelInfo(D.GetModelInfoRequest()).stats
    assert stats.accepted_tokens > 0, stats             # speculation ran, and changed no token
    wait_idle(stub)


def test_adapter_streams_equal_peft(served):
    _, folder, adapter, stub = served
    peft = peft_mixed(folder, {ADAPTER.name: adapter})
    want = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
            want.append(out[0, len(prompt):].tolist())
    requests = [greedy(p) for p in PROMPTS] + [greedy(p) for p in PROMPTS]
    for r in requests[:len(PROMPTS)]:
        r.adapter = ADAPTER.name
    with ThreadPoolExecutor(len(requests)) as pool:
        got = [tokens for tokens, _ in pool.map(lambda r: generate(stub, r), requests)]
    assert got[:len(PROMPTS)] == want
    assert got[len(PROMPTS):] == greedy_reference(folder, PROMPTS, MAX_TOKENS) != want
    wait_idle(stub)


def test_json_schema_output_parses_and_matches(served):
    _, _, _, stub = served
    sampling = D.SamplingParams(temperature=1.0, seed=4, max_tokens=40,
                                structured_output=D.StructuredOutput(json_schema=json.dumps(SCHEMA)))
    tokens, finish = generate(stub, D.GenerateRequest(text='As JSON: {"n": ', sampling=sampling))
    assert finish == D.FINISH_REASON_STOP
    jsonschema.validate(json.loads(char_tokenizer().decode(tokens)), SCHEMA)


def test_the_plan_says_what_the_family_does_not_run(served):
    family, _, _, stub = served
    plan = {c.name: c for c in stub.GetModelInfo(D.GetModelInfoRequest()).execution_plan.choices}
    for path, why in REFUSED[family].items():
        assert plan[path].chosen in ("off", "torch") and why in plan[path].reason, plan[path]
