"""A Qwen2.5-VL image chat end to end through the gateway: a vision service and a decoder (as subprocesses) on
one tiny random Qwen2.5-VL checkpoint, the gateway under uvicorn, driven by the official `openai` client.

The checkpoint is random, so the checks are about agreement: the greedy answer (text, each token's logprob,
the expanded prompt length) equals transformers' Qwen2_5_VLForConditionalGeneration.generate on the same
checkpoint, prompt and photos, and a stream equals the whole answer. The image plumbing shared with Qwen2-VL
(limits, bad inputs, the feature cache) is tests/gateway/test_images.py's."""
from __future__ import annotations

import pytest
import torch

from gateway.config import GatewayConfig
from tests.conftest import free_port
from tests.decoder.multimodal.conftest import photo
from tests.gateway.fleet import GatewayThread, clients, python_module, stop, wait_serving
from tests.gateway.test_images import BLOCK, KEY, NEW, QUESTION, ask, data_uri, expected, image_part
from tests.tolerance import assert_close
from tests.vision.checkpoints import VL_SHAPE_2_5, write_qwen2_5_vl

VL = "tiny-qwen2.5-vl"


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return write_qwen2_5_vl(tmp_path_factory.mktemp("images") / "tiny-qwen2.5-vl", seed=6)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, vl_checkpoint):
    logs = tmp_path_factory.mktemp("image-logs")
    ports = {name: free_port() for name in ("vision", "vl")}
    procs = []
    try:
        procs.append(python_module("services.vision", [
            "--model", str(vl_checkpoint), "--host", "127.0.0.1", "--port", str(ports["vision"]), "--threads", "1"],
            logs / "vision.log"))
        procs.append(python_module("services.decoder", [
            "--model", str(vl_checkpoint), "--served-model-name", VL, "--port", str(ports["vl"]), "--host",
            "127.0.0.1", "--num-blocks", "512", "--block-size", str(BLOCK), "--max-num-batched-tokens", "64",
            "--max-model-len", "1024", "--threads", "1"], logs / "decoder-vl.log"))
        addresses = {name: f"127.0.0.1:{ports[name]}" for name in ports}
        wait_serving(addresses["vision"], "tessera.vision.v1.VisionService", procs[0])
        wait_serving(addresses["vl"], "tessera.decoder.v1.DecoderService", procs[1])
        cfg = GatewayConfig(host="127.0.0.1", port=free_port(), decoder=(addresses["vl"],),
                            vision=addresses["vision"], api_key=KEY)
        with GatewayThread(cfg) as gw, clients(gw.url, KEY) as served:
            yield {**served, "procs": procs}
    finally:
        for proc in reversed(procs):
            stop(proc)


@pytest.fixture(scope="module")
def reference(vl_checkpoint):
    from transformers import Qwen2_5_VLForConditionalGeneration
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_checkpoint, dtype=torch.float32).eval()


@pytest.mark.numerics
def test_image_chat_equals_transformers_greedy(client, vl_checkpoint, reference):
    rocket = photo("rocket.jpg")    # not square: the tower's windows are cut short at the edges
    want = expected(vl_checkpoint, reference, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": QUESTION}]}], [rocket], NEW)
    reply = client.chat.completions.create(model=VL, messages=ask(data_uri(rocket, "image/jpeg")), max_tokens=NEW,
                                           temperature=0, logprobs=True)
    choice = reply.choices[0]
    assert choice.message.content == want["text"] and choice.finish_reason == want["finish"]
    assert reply.usage.completion_tokens == len(want["ids"])
    assert_close([entry.logprob for entry in choice.logprobs.content], want["logprobs"], **VL_SHAPE_2_5)
    assert reply.usage.prompt_tokens == want["prompt_tokens"]


@pytest.mark.numerics
def test_two_images_in_one_message_equal_transformers_greedy(client, vl_checkpoint, reference):
    coffee, cat = photo("coffee.png"), photo("chelsea.png")
    want = expected(vl_checkpoint, reference, [{"role": "user", "content": [
        {"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare them."}]}], [coffee, cat], 4)
    msgs = [{"role": "user", "content": [image_part(data_uri(coffee)), image_part(data_uri(cat)),
                                         {"type": "text", "text": "Compare them."}]}]
    reply = client.chat.completions.create(model=VL, messages=msgs, max_tokens=4, temperature=0, logprobs=True)
    assert reply.choices[0].message.content == want["text"] and reply.usage.prompt_tokens == want["prompt_tokens"]
    assert_close([entry.logprob for entry in reply.choices[0].logprobs.content], want["logprobs"], **VL_SHAPE_2_5)


def test_streaming_an_image_chat_equals_the_whole_answer(client):
    msgs = ask(data_uri(photo("astronaut.png")), "Describe it.")
    whole = client.chat.completions.create(model=VL, messages=msgs, max_tokens=NEW, temperature=0)
    chunks = list(client.chat.completions.create(model=VL, messages=msgs, max_tokens=NEW, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
