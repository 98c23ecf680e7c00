"""The real SmolLM2-135M-Instruct behind the decoder service and the gateway answers sensibly through the
official `openai` client (the `make up` path, with the model `make models` prepares)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

from gateway.config import GatewayConfig
from tests.conftest import free_port
from tests.decoder.server.conftest import need_smollm2
from tests.gateway.fleet import GatewayThread, clients, python_module, stop, wait_serving

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    port = free_port()
    decoder = python_module("services.decoder", [
        "--model", str(need_smollm2()), "--host", "127.0.0.1", "--port", str(port), "--num-blocks", "64",
        "--threads", "1"], tmp_path_factory.mktemp("logs") / "decoder.log")
    try:
        wait_serving(f"127.0.0.1:{port}", "tessera.decoder.v1.DecoderService", decoder)
        cfg = GatewayConfig(host="127.0.0.1", port=free_port(), decoder=(f"127.0.0.1:{port}",))
        with GatewayThread(cfg) as gw, clients(gw.url, None) as served:
            yield served
    finally:
        stop(decoder)


def test_capital_of_france_is_paris(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    answer = whole.choices[0].message.content
    assert "Paris" in answer, answer
    streamed = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again hits the prefix cache


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tools_on_the_make_up_model(client):
    """SmolLM2's template has no tool format: a forced call (required, named) is valid; auto is a clear 400."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice=choice,
                                               parallel_tool_calls=False, max_tokens=64, temperature=0).choices[0]
        assert reply.finish_reason == "tool_calls", reply
        call = reply.message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER])


def test_lm_eval_loglikelihood_request_equals_transformers(client, http):
    """lm-evaluation-harness's scoring request (echo, logprobs, max_tokens 0): the prompt's token logprobs equal
    transformers' on the same ids within the shared tolerance."""
    from transformers import AutoModelForCausalLM

    from tests.tolerance import assert_close
    prompt = "Question: What is the capital of France?\nAnswer: Paris"
    reply = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    lp = reply.choices[0].logprobs
    assert reply.choices[0].text == prompt and lp.token_logprobs[0] is None
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
    assert len(ids) == len(lp.tokens) == reply.usage.prompt_tokens
    model = AutoModelForCausalLM.from_pretrained(need_smollm2(), dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert_close(lp.token_logprobs[1:], expected, k=1536, depth=30, what="SmolLM2 prompt logprobs")
