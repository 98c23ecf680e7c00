"""Images end to end through the gateway: real redis-server, vision service and two decoders (a tiny random
Qwen2-VL and a text-only tiny Llama) as subprocesses, the gateway under uvicorn, driven by the official `openai`
client and httpx.

The Qwen2-VL checkpoint is random, so the checks are about agreement: greedy text equals transformers'
Qwen2VLForConditionalGeneration.generate on the same checkpoint, prompt and photo; the same image twice is a
vision feature-cache hit and a decoder prefix-cache hit; a stream equals the whole answer. Every bad input is a
clear 4xx in OpenAI's error shape, refusals the gateway can make itself never reach the vision service (the
image limits it checks are the VL decoder's, read from its GetModelInfo: the gateway has none of its own), and
every service is still up afterwards (docs/design.md, invariants 8 and 9)."""
from __future__ import annotations

import base64
import io
import re
import struct
import zlib

import anthropic
import httpx
import pytest
import torch
from PIL import Image

from gateway.config import GatewayConfig
from tests.conftest import free_port
from tests.decoder.multimodal.conftest import photo
from tests.decoder.multimodal.helpers import reference_inputs
from tests.gateway.fleet import GatewayThread, clients, python_module, redis_process, stop, wait_serving
from tests.tolerance import assert_close
from tests.vision.checkpoints import VL_SHAPE, token_ids, write_qwen2_vl

KEY = "sk-images-tenant-key"
OTHER_KEY = "sk-images-other-tenant"   # a second --api-key: a tenant of its own
VL, TEXT_ONLY = "tiny-vl", "tiny-chat"
BLOCK = 4
MAX_IMAGES = 3
MAX_IMAGE_BYTES = 1 << 20
NEW = 8
EOS = token_ids()["<|im_end|>"]
QUESTION = "What is in this picture?"


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(url: str, text: str = QUESTION) -> list[dict]:
    """One user turn: the image, then the question (OpenAI's shape)."""
    return [{"role": "user", "content": [image_part(url), {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return write_qwen2_vl(tmp_path_factory.mktemp("images") / "tiny-qwen2-vl", seed=5)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, vl_checkpoint, tiny_chat_model):
    logs = tmp_path_factory.mktemp("image-logs")
    ports = {name: free_port() for name in ("redis", "vision", "vl", "text")}
    procs = [redis_process(ports["redis"], logs)]
    decoder_flags = ["--host", "127.0.0.1", "--num-blocks", "512", "--block-size", str(BLOCK),
                     "--max-num-batched-tokens", "64", "--max-model-len", "1024", "--threads", "1"]
    try:
        # All three load at once; each waits for nothing but its own model.
        procs.append(python_module("services.vision", [
            "--model", str(vl_checkpoint), "--host", "127.0.0.1", "--port", str(ports["vision"]), "--threads", "1",
            "--redis-url", f"redis://127.0.0.1:{ports['redis']}/0"], logs / "vision.log"))
        procs.append(python_module("services.decoder", [
            "--model", str(vl_checkpoint), "--served-model-name", VL, "--port", str(ports["vl"]),
            "--max-images", str(MAX_IMAGES), "--max-image-bytes", str(MAX_IMAGE_BYTES), *decoder_flags],
            logs / "decoder-vl.log"))
        procs.append(python_module("services.decoder", [
            "--model", str(tiny_chat_model), "--served-model-name", TEXT_ONLY, "--port", str(ports["text"]),
            *decoder_flags], logs / "decoder-text.log"))
        addresses = {name: f"127.0.0.1:{ports[name]}" for name in ("vision", "vl", "text")}
        wait_serving(addresses["vision"], "tessera.vision.v1.VisionService", procs[1])
        wait_serving(addresses["vl"], "tessera.decoder.v1.DecoderService", procs[2])
        wait_serving(addresses["text"], "tessera.decoder.v1.DecoderService", procs[3])
        cfg = GatewayConfig(host="127.0.0.1", port=free_port(), decoder=(addresses["vl"], addresses["text"]),
                            vision=addresses["vision"], api_key=f"{KEY},{OTHER_KEY}",
                            model_note=(f"{VL}=random weights",))
        # The same decoders without a vision service: image parts must be refused, not dropped.
        blind = GatewayConfig(host="127.0.0.1", port=free_port(), decoder=(addresses["vl"],), api_key=KEY)
        with GatewayThread(cfg) as gw, GatewayThread(blind) as gw_blind, clients(gw.url, KEY) as served:
            yield {**served, "blind_url": gw_blind.url, "procs": procs, "logs": logs}
    finally:
        for proc in reversed(procs):
            stop(proc)


@pytest.fixture(scope="module")
def reference(vl_checkpoint):
    from transformers import Qwen2VLForConditionalGeneration
    return Qwen2VLForConditionalGeneration.from_pretrained(vl_checkpoint, dtype=torch.float32).eval()


def images_sent(http) -> dict[str, float]:
    """The gateway's count of images the vision service answered, by source (cache | encoder)."""
    text = http.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r'^tessera_gateway_images_total\{source="(\w+)"\} (\S+)$',
                                                    text, re.M)}


def expected(vl_checkpoint, reference, msgs: list[dict], datas: list[bytes], max_tokens: int) -> dict:
    """transformers' greedy answer: its ids (cut after the first EOS, where our decoder stops), their text and
    logprobs, the prompt length and where the first image's placeholder rows end."""
    ref = reference_inputs(vl_checkpoint, msgs, datas)
    with torch.no_grad():
        out = reference.generate(**ref.kwargs(), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    ids = out.sequences[0, ref.input_ids.shape[1]:].tolist()
    stopped = EOS in ids
    ids = ids[:ids.index(EOS) + 1] if stopped else ids
    # Greedy applies no logits processor, so the scores are the logits: each chosen token's logprob.
    logprobs = [torch.log_softmax(score[0], -1)[i].item() for score, i in zip(out.scores, ids, strict=False)]
    from transformers import AutoTokenizer
    text = AutoTokenizer.from_pretrained(vl_checkpoint).decode(ids, skip_special_tokens=True)
    image_positions = ref.mm_token_type_ids[0].nonzero().flatten().tolist()
    return {"ids": ids, "text": text, "logprobs": logprobs, "finish": "stop" if stopped else "length",
            "prompt_tokens": ref.input_ids.shape[1], "image_end": image_positions[-1] + 1}


def test_models_say_which_model_takes_images(client):
    cards = {m.id: m.model_extra for m in client.models.list().data}
    assert cards[VL]["supports_images"] is True and cards[TEXT_ONLY]["supports_images"] is False
    assert cards[VL]["note"] == "random weights" and "note" not in cards[TEXT_ONLY]
    assert client.models.retrieve(VL).model_extra["note"] == "random weights"


@pytest.mark.numerics
def test_image_chat_equals_transformers_greedy(client, vl_checkpoint, reference):
    cat = photo("chelsea.png")
    want = expected(vl_checkpoint, reference, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": QUESTION}]}], [cat], NEW)
    reply = client.chat.completions.create(model=VL, messages=ask(data_uri(cat)), max_tokens=NEW, temperature=0,
                                           logprobs=True)
    choice = reply.choices[0]
    assert choice.message.content == want["text"] and choice.finish_reason == want["finish"]
    assert reply.usage.completion_tokens == len(want["ids"])
    # The text of a random byte-level model hides ids (unused ids decode to nothing); the chosen tokens'
    # logprobs, step after step, pin them: one different id would change every later distribution.
    got = [entry.logprob for entry in choice.logprobs.content]
    assert_close(got, want["logprobs"], **VL_SHAPE)
    # Expanded: one prompt position per image row, as transformers' processor counts them.
    assert reply.usage.prompt_tokens == want["prompt_tokens"]


@pytest.mark.numerics
def test_images_in_two_messages_keep_their_order(client, vl_checkpoint, reference):
    """ContentPart.image_index follows message order: coffee is image 0 (first turn), the rocket image 1."""
    coffee, rocket = photo("coffee.png"), photo("rocket.jpg")
    turns = [("What is this?", "A drink."), ("And this one?", None)]
    ours, theirs = [], []
    for (question, answer), (data, mime) in zip(turns, [(coffee, "image/png"), (rocket, "image/jpeg")],
                                                strict=True):
        ours.append({"role": "user", "content": [image_part(data_uri(data, mime)), {"type": "text",
                                                                                    "text": question}]})
        theirs.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]})
        if answer:
            ours.append({"role": "assistant", "content": answer})
            theirs.append({"role": "assistant", "content": answer})
    want = expected(vl_checkpoint, reference, theirs, [coffee, rocket], 4)
    swapped = expected(vl_checkpoint, reference, theirs, [rocket, coffee], 4)
    assert swapped["logprobs"] != want["logprobs"], "the two orders must be told apart for this test to mean anything"
    reply = client.chat.completions.create(model=VL, messages=ours, max_tokens=4, temperature=0, logprobs=True)
    assert reply.choices[0].message.content == want["text"] and reply.usage.prompt_tokens == want["prompt_tokens"]
    got = [entry.logprob for entry in reply.choices[0].logprobs.content]
    assert_close(got, want["logprobs"], **VL_SHAPE)


def test_the_same_image_twice_hits_the_feature_cache_and_the_prefix_cache(client, http, vl_checkpoint, reference):
    astronaut = photo("astronaut.png")
    want = expected(vl_checkpoint, reference, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Who is this?"}]}], [astronaut], 4)
    msgs = ask(data_uri(astronaut), "Who is this?")
    before = images_sent(http)
    first = client.chat.completions.create(model=VL, messages=msgs, max_tokens=4, temperature=0)
    middle = images_sent(http)
    second = client.chat.completions.create(model=VL, messages=msgs, max_tokens=4, temperature=0)
    after = images_sent(http)
    assert middle.get("encoder", 0) - before.get("encoder", 0) == 1          # computed once
    assert after.get("cache", 0) - middle.get("cache", 0) == 1               # then a Redis hit
    assert after.get("encoder", 0) == middle.get("encoder", 0)
    # The first call shares at most the system prompt; the second reuses every full block through the image.
    assert first.usage.prompt_tokens_details.cached_tokens < want["image_end"]
    assert second.usage.prompt_tokens_details.cached_tokens >= want["image_end"] // BLOCK * BLOCK
    # usage says it too: one image each time, computed the first time, from the feature cache the second.
    assert first.usage.prompt_tokens_details.model_extra == {"images": 1, "cached_images": 0}
    assert second.usage.prompt_tokens_details.model_extra == {"images": 1, "cached_images": 1}
    assert first.choices[0].message.content == second.choices[0].message.content == want["text"]


def test_one_tenants_images_are_never_anothers_cache_hits(client, fleet):
    """Two API keys are two tenants: an image one sent is computed again for the other (cached_images 0, and none
    of its prefix blocks), so neither the count nor the time saved tells the other what the first sent."""
    raw = io.BytesIO()
    Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48).save(raw, "PNG")   # an image no other test sends
    msgs = ask(data_uri(raw.getvalue()), "What is this?")
    with clients(fleet["url"], OTHER_KEY) as other:
        def usage(c):
            reply = c.chat.completions.create(model=VL, messages=msgs, max_tokens=1, temperature=0)
            details = reply.usage.prompt_tokens_details
            return details.model_extra["cached_images"], details.cached_tokens
        first = usage(client)
        assert first[0] == 0
        theirs = usage(other["client"])
        assert theirs == (0, 0), theirs        # not a hit of the first tenant's image, nor of its blocks
        assert usage(client)[0] == 1 and usage(other["client"])[0] == 1   # each tenant hits its own


def test_streaming_an_image_chat_equals_the_whole_answer(client):
    msgs = ask(data_uri(photo("chelsea.png"), "image/png"), "Describe it.")
    whole = client.chat.completions.create(model=VL, messages=msgs, max_tokens=NEW, temperature=0)
    chunks = list(client.chat.completions.create(model=VL, messages=msgs, max_tokens=NEW, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def png_header(width: int, height: int) -> bytes:
    """A 1x1 PNG whose IHDR chunk claims width x height pixels: a header is all a bomb needs to carry."""
    raw = io.BytesIO()
    Image.new("RGB", (1, 1)).save(raw, "PNG")
    raw = raw.getvalue()
    chunk = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return raw[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + raw[33:]


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'


def bad_inputs() -> dict[str, tuple[list[dict], str, int, str, bool]]:
    """case -> (messages, model, status, words in the message, whether the vision service may be asked)."""
    cat = photo("chelsea.png")
    one = ask
    return {
        "truncated_png": (one(data_uri(cat[:2000])), VL, 400, "messages[0].content[0]", True),
        "zero_bytes": (one("data:image/png;base64,"), VL, 400, "empty", False),
        "non_image_bytes": (one(data_uri(b"plain text, not pixels " * 20)), VL, 400, "not a decodable", True),
        "svg_mime": (one(data_uri(SVG, "image/svg+xml")), VL, 400, "unsupported image type", False),
        "svg_bytes_as_png": (one(data_uri(SVG)), VL, 400, "SVG", True),
        "unsupported_mime": (one(data_uri(cat, "image/bmp")), VL, 400, "unsupported image type", False),
        "not_an_image_mime": (one(data_uri(cat, "text/plain")), VL, 400, "unsupported image type", False),
        "20000x20000": (one(data_uri(png_header(20000, 20000))), VL, 413, "pixels", True),
        "over_the_byte_limit": (one(data_uri(b"\x89PNG" + bytes(MAX_IMAGE_BYTES))), VL, 413, "limit", False),
        "too_many_images": ([{"role": "user", "content": [image_part(data_uri(cat))] * (MAX_IMAGES + 1)}], VL,
                            413, f"at most {MAX_IMAGES} per request", False),
        "text_only_model": (one(data_uri(cat)), TEXT_ONLY, 400, "text-only", False),
        "remote_url": (one("https://example.com/cat.png"), VL, 400, "nothing is fetched", False),
        "remote_url_on_text_model": (one("http://10.0.0.1/x.png"), TEXT_ONLY, 400, "nothing is fetched", False),
        "not_a_data_uri": (one("file:///etc/passwd"), VL, 400, "data: URI", False),
        "data_uri_without_base64": (one("data:image/png,abc"), VL, 400, "base64", False),
        "data_uri_without_comma": (one("data:image/png;base64"), VL, 400, "malformed", False),
        "data_uri_bad_base64": (one("data:image/png;base64,@@@@"), VL, 400, "base64", False),
        "detail_high": ([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(cat), "detail": "high"}}]}], VL, 400, "detail",
            False),
    }


def test_responses_and_messages_take_the_image_as_chat_does(client, fleet):
    """The Responses API's input_image and the Messages API's base64 image block reach the model as chat's
    image_url part does: the same greedy answer and prompt length."""
    cat = photo("chelsea.png")
    chat = client.chat.completions.create(model=VL, messages=ask(data_uri(cat)), max_tokens=NEW, temperature=0)
    answer = chat.choices[0].message.content
    reply = client.responses.create(model=VL, max_output_tokens=NEW, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_uri(cat)}, {"type": "input_text", "text": QUESTION}]}])
    assert reply.output_text == answer and reply.usage.input_tokens == chat.usage.prompt_tokens
    claude = anthropic.Anthropic(base_url=fleet["url"], api_key=KEY, max_retries=0)
    message = claude.messages.create(model=VL, max_tokens=NEW, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(cat).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == answer
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("case", sorted(bad_inputs()))
def test_bad_image_input_is_a_clear_4xx(http, case):
    msgs, model, status, words, vision_may_see = bad_inputs()[case]
    before = images_sent(http)
    for stream in (False, True):  # a refused stream is a plain HTTP error too, before any event
        reply = http.post("/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": 2,
                                                        "stream": stream})
        assert reply.status_code == status, reply.text
        err = reply.json()["error"]
        assert err["param"] == "messages" and words in err["message"], err
        assert err["type"] == "invalid_request_error" and err["code"] in ("invalid_argument", "unsupported",
                                                                          "too_large")
    if not vision_may_see:  # refused by the gateway itself: no vision work was spent on it
        assert images_sent(http) == before


def test_a_gateway_without_vision_refuses_images_clearly(fleet):
    reply = httpx.post(fleet["blind_url"] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": VL, "messages": ask(data_uri(photo("chelsea.png")))}, timeout=60)
    assert reply.status_code == 400 and "--vision" in reply.json()["error"]["message"], reply.text


def test_every_service_is_still_up_after_the_bad_inputs(client, http, fleet):
    """Runs last in this module: nothing above took a process down, and an image chat still works."""
    assert all(proc.poll() is None for proc in fleet["procs"])
    assert http.get("/ready").status_code == 200
    reply = client.chat.completions.create(model=VL, messages=ask(data_uri(photo("chelsea.png"))), max_tokens=2,
                                           temperature=0)
    assert reply.usage.completion_tokens >= 1
