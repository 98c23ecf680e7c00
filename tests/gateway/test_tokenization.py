"""POST /tokenize and /detokenize end to end (gateway -> decoder) on the tiny chat model: ids equal the tokenizer's,
the chat form equals the prompt a chat completion runs, round trips, and every refusal is a 400/404 naming the
field with the decoder still serving. Routing by an adapter's name is checked in test_adapters.py."""
from __future__ import annotations

import httpx
import pytest
from tokenizers import Tokenizer

from tests.gateway.chat_fleet import MAX_LEN, MODEL, still_up

HELLO = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hello, who are you?"}]
TEXT = "Tokenizers split text: naïve café, 3.14159 and <|im_start|> too."


@pytest.fixture(scope="module")
def ref(tiny_chat_model):
    return Tokenizer.from_file(str(tiny_chat_model / "tokenizer.json"))


def post(fleet, path, body) -> dict:
    reply = fleet["http"].post(path, json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_prompt_form_equals_the_tokenizer(fleet, ref):
    got = post(fleet, "/tokenize", {"model": MODEL, "prompt": TEXT})
    ids = ref.encode(TEXT).ids
    assert got == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids, "token_strs": None}
    strs = post(fleet, "/tokenize", {"prompt": TEXT, "return_token_strs": True, "add_special_tokens": False})
    assert strs["tokens"] == ref.encode(TEXT, add_special_tokens=False).ids
    assert strs["token_strs"] == [ref.id_to_token(i) for i in strs["tokens"]]
    assert post(fleet, "/tokenize", {"prompt": ""})["count"] == len(ref.encode("").ids)
    paths = fleet["http"].get("/openapi.json").json()["paths"]
    assert {"/tokenize", "/detokenize"} <= set(paths)


def test_chat_form_is_what_a_chat_completion_prompts_with(fleet, ref):
    got = post(fleet, "/tokenize", {"model": MODEL, "messages": HELLO})
    done = fleet["client"].chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=1)
    assert got["count"] == done.usage.prompt_tokens == len(got["tokens"])
    text = post(fleet, "/detokenize", {"model": MODEL, "tokens": got["tokens"]})["prompt"]
    assert text.endswith("<|im_start|>assistant\n") and ref.encode(text, add_special_tokens=False).ids == got["tokens"]
    bare = post(fleet, "/tokenize", {"messages": HELLO, "add_generation_prompt": False})["tokens"]
    assert got["tokens"][:len(bare)] == bare and len(bare) < got["count"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, who are you?"}]}]
    assert post(fleet, "/tokenize", {"messages": parts})["tokens"] == \
        post(fleet, "/tokenize", {"messages": [{"role": "user", "content": "Hello, who are you?"}]})["tokens"]


def test_round_trip(fleet, ref):
    for text in (TEXT, "plain words", " leading space", "emoji 🙂 and tabs\t\n"):
        ids = post(fleet, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
        assert post(fleet, "/detokenize", {"tokens": ids}) == {"prompt": text}
    assert post(fleet, "/detokenize", {"tokens": []}) == {"prompt": ""}
    # Special tokens are kept, as vLLM's decode does.
    assert post(fleet, "/detokenize", {"tokens": [1, 2]})["prompt"] == ref.decode([1, 2], skip_special_tokens=False)


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": HELLO}, 400, "messages"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": [IMAGE]}]}, 400, "messages"),
    ("/tokenize", {"messages": HELLO, "tools": []}, 400, "tools"),
    ("/tokenize", {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]},
     400, "tools"),
    ("/tokenize", {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/tokenize", {"prompt": "hi", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"prompt": "hi", "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ("/detokenize", {"tokens": [5, 49152]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [2**63]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["5"]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [5], "model": "no-such-model"}, 404, "model"),
])
def test_bad_input_is_a_clear_error(fleet, path, body, status, param):
    reply = fleet["http"].post(path, json=body)
    assert reply.status_code == status, reply.text
    err = reply.json()["error"]
    assert err["message"] and err["param"] == param, err
    still_up(fleet)


def test_needs_the_api_key(fleet):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        assert httpx.post(fleet["url"] + path, json=body, timeout=10).status_code == 401
