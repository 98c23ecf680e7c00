"""/v1/completions and /v1/chat/completions end to end: the real decoder service (a subprocess on a tiny random
Llama with SmolLM2's real tokenizer and chat template) behind the real gateway, driven by the official `openai`
client and httpx. The model's words are noise, so the checks are about agreement: streamed == whole, token ids ==
text, logprobs consistent with the tokens, seeds reproducible, stop strings cut, and nothing leaked in the engine
(GetModelInfo stats back to idle, the decoder's finish counters unchanged after a disconnect)."""
from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.conftest import free_port
from tests.decoder.idle import stats
from tests.gateway.chat_fleet import MODEL, chat_fleet, still_up, wait_idle

MAX_LEN = 4096  # past the checkpoint's 256 positions: RoPE needs no table, and long streams make disconnects real
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_chat_model):
    logs, metrics = tmp_path_factory.mktemp("logs"), free_port()
    with chat_fleet(tiny_chat_model, logs, ("--metrics-port", str(metrics), "--num-blocks", "1024",
                                            "--max-num-batched-tokens", "32", "--max-model-len", str(MAX_LEN))) as f:
        yield {**f, "metrics": f"http://127.0.0.1:{metrics}/metrics"}


def finished(fleet) -> float:
    """Requests the decoder finished normally (any finish reason) so far, from its /metrics."""
    text = httpx.get(fleet["metrics"], timeout=5).text
    return sum(float(v) for v in re.findall(r'^tessera_decoder_requests_total\{[^}]*\} (\S+)$', text, re.M))


def events(lines) -> list:
    """The JSON payloads of an SSE body, up to and including the [DONE] marker (as the string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
            if data == "[DONE]":
                break
    return out


def test_models_lists_the_decoder_model(client, http):
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions"} <= set(paths)
    card = client.models.retrieve(MODEL)
    assert card.model_extra["kind"] == "generation" and card.model_extra["max_model_len"] == MAX_LEN
    assert card.model_extra["has_chat_template"] is True and card.model_extra["supports_images"] is False
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_whole_and_streamed_agree_with_usage(client, fleet):
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and whole.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 10
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    # The same conversation again: its full prompt blocks come from the prefix cache.
    assert last.usage.prompt_tokens_details.cached_tokens >= 4 * ((whole.usage.prompt_tokens - 1) // 4) - 4
    assert all(c.usage is None for c in chunks[:-1])
    wait_idle(fleet)


def test_completions_token_prompt_equals_text_prompt(client, tiny_chat_model):
    text = "The quick brown fox jumps over"
    ids = Tokenizer.from_file(str(tiny_chat_model / "tokenizer.json")).encode(text).ids
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_text.choices[0].text
    assert by_text.object == "text_completion" and by_text.choices[0].finish_reason == "length"


def test_n2_seeded_sampling_is_reproducible(client):
    def ask():
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, n=2,
                                         temperature=1.0, top_p=0.9, seed=1234)
    a, b = ask(), ask()
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # each choice draws its own tokens
    assert a.usage.completion_tokens == 20
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=6, n=2, seed=5)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 12


def test_completion_logprobs_match_tokens_and_stream(client, http):
    whole = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=8, temperature=0, logprobs=3)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and chosen <= 0
        # Greedy takes the argmax of the logits; log_softmax is a shift, and rounding is monotonic.
        assert chosen == max(top.values())
    with http.stream("POST", "/v1/completions", json={"prompt": "Paris is", "max_tokens": 8, "temperature": 0,
                                                      "logprobs": 3, "stream": True}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        got = events(reply.iter_lines())
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.choices[0].text
    assert [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]] == lp.tokens
    assert [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]] == lp.text_offset
    assert "usage" not in chunks[-1]


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode())
        assert t.logprob == t.top_logprobs[0].logprob


def test_prompt_list_fans_out(client):
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text
              for p in ("red", "blue")]
    both = client.completions.create(model=MODEL, prompt=["red", "blue"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [single[0], single[0], single[1], single[1]]
    assert both.usage.completion_tokens == 16
    streamed = client.completions.create(model=MODEL, prompt=["red", "blue"], max_tokens=4, temperature=0,
                                         stream=True)
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == single


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=16, temperature=0).choices[0].text
    stop = base[6:9]
    assert stop.strip(), base
    cut = client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=16, temperature=0, stop=[stop, "\x00"])
    assert cut.choices[0].text == base[:base.index(stop)] and cut.choices[0].finish_reason == "stop"


TOO_LONG = "word " * (MAX_LEN + 10)


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": TOO_LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 99}, 400, "n"),
    ("/v1/completions", {"prompt": [5, 49152]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, -1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 40}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 1000}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": ["a"] * 17}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "audio", "x": 1}]}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages"),
    # Role rules are the decoder's (services/decoder/server/validation.py), reached through the gateway.
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "21"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_call_id": "a"}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [*HELLO, {"role": "tool", "content": "21", "tool_call_id": "a"}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": HELLO, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": HELLO, "max_completion_tokens": MAX_LEN}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": HELLO, "top_logprobs": 2}, 400, None),
    ("/v1/chat/completions", {"messages": HELLO, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": HELLO, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": HELLO, "tools": []}, 400, "tools"),
    # SmolLM2's template renders no tools, so tool_choice "auto" (the default with tools) is refused.
    ("/v1/chat/completions", {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tool_choice"),
])
def test_bad_input_is_a_clear_4xx_and_nothing_leaks(http, fleet, path, body, status, param):
    for stream in (False, True):  # a refused stream is a plain HTTP error too, before any event
        if stream and "stream_options" in body:
            continue
        reply = http.post(path, json={**body, "stream": stream})
        assert reply.status_code == status, reply.text
        err = reply.json()["error"]
        assert err["message"] and err["param"] == param, err
    still_up(fleet)


def test_remote_image_is_never_fetched(http):
    reply = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://10.0.0.1/x"}}]}]})
    assert reply.status_code == 400 and "nothing is fetched" in reply.json()["error"]["message"]


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=HELLO)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_LEN)
    assert "context length" in str(exc.value)


def test_client_disconnect_mid_stream_aborts_the_request(http, fleet):
    before = finished(fleet)
    # min_tokens keeps the random model's eos away, whichever greedy path its load-time kernel choice gives
    body = {"prompt": "Tell me a long story", "max_tokens": 2000, "min_tokens": 2000, "temperature": 0,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        # Held: a dropped line generator closes the response as soon as it is collected, which would race the
        # check below against the very disconnect it is meant to precede.
        lines = reply.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen == 3:
                break
        time.sleep(0.5)  # the client is still there: the request must still be running
        assert stats(fleet["stub"]).running == 1  # still generating when the client leaves
        lines.close()
    wait_idle(fleet)
    assert finished(fleet) == before  # aborted, not run to its 2000 tokens
    # A whole (non-streamed) answer is cancelled too when its client gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2000, "min_tokens": 2000,
                                                "temperature": 0},
                  timeout=httpx.Timeout(60, read=0.5))
    wait_idle(fleet)
    assert finished(fleet) == before
    still_up(fleet)


def test_backend_dying_mid_stream_ends_with_an_error_event(http, fleet):
    """Last in this module: it kills the decoder."""
    body = {"messages": HELLO, "max_tokens": 2000, "min_tokens": 2000, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen == 3:
                break
        fleet["decoder"].kill()
        rest = events(lines)
    assert rest[-1] == "[DONE]"
    err = rest[-2]["error"]
    assert err["code"] == "unavailable" and err["type"] == "service_unavailable_error", err
    fleet["decoder"].wait(10)
    reply = http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2})
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "unavailable", reply.text
