"""Structured outputs end to end (gateway -> decoder) through the official `openai` client: response_format
(json_object, json_schema) and vLLM's structured_outputs (json, regex, choice, grammar) on both generation
endpoints.

The model is the tiny random chat model: left alone it writes garbage, so every valid output below is the
grammar's doing. Covered: streaming and not, temperature 0 and seeded temperature 1, n=2, a constrained row
beside unconstrained ones, an adapter row beside a constrained row and a KV pool small enough to preempt
requests mid-object (a second decoder), max_tokens cutting an object (finish_reason length), and every bad
input as a 400 in OpenAI's shape with the decoder serving afterwards.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from services.common.pb import decoder_pb2
from tests.decoder.grammar.cases import CHOICES, REGEX, SCHEMA
from tests.decoder.lora.adapters import Spec, write_adapter
from tests.gateway.chat_fleet import MODEL, chat_fleet, still_up, wait_idle

FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "description": "a person", "schema": SCHEMA,
                                                 "strict": True}}
GRAMMAR = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [0-9]{1,3}'
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
ADAPTER = "tinylora"


@pytest.fixture(scope="module")
def squeezed(tmp_path_factory, tiny_chat_model):
    """A second decoder: a 40-block KV pool (160 tokens), no prefix sharing, prefill chunks of 16 tokens and
    an adapter preloaded, so concurrent requests are preempted while their objects are open."""
    tmp = tmp_path_factory.mktemp("structured-squeezed")
    adapter = write_adapter(tiny_chat_model, tmp / "adapters", Spec(ADAPTER, 4, 8.0, ("q_proj", "v_proj"), 41),
                            scale=0.5)
    with chat_fleet(tiny_chat_model, tmp, ("--num-blocks", "40", "--max-num-batched-tokens", "16",
                                           "--no-enable-prefix-caching", "--lora", f"{ADAPTER}={adapter}",
                                           "--max-lora-rank", "8")) as f:
        yield f


def person(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    return value


def chat(client, **kw):
    kw.setdefault("max_completion_tokens", 100)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=kw.pop("model", MODEL), messages=kw.pop("messages", ASK), **kw)


def test_json_schema_streamed_and_not(client):
    whole = chat(client, response_format=FORMAT)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop" and person(choice.message.content)
    chunks = list(chat(client, response_format=FORMAT, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_seeded_sampling_is_valid_and_reproducible(client):
    texts = [chat(client, response_format=FORMAT, temperature=1.0, seed=s).choices[0].message.content
             for s in (1, 2, 3)]
    for text in texts:
        person(text)
    assert len(set(texts)) > 1
    assert chat(client, response_format=FORMAT, temperature=1.0, seed=2).choices[0].message.content == texts[1]


def test_n_choices_each_follow_the_schema(client):
    reply = chat(client, response_format=FORMAT, temperature=1.0, seed=7, n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    for c in reply.choices:
        assert c.finish_reason == "stop" and person(c.message.content)


def test_structured_outputs_kinds_on_both_endpoints(client):
    schema_text = json.dumps(SCHEMA)
    for body, check in (({"json": SCHEMA}, person), ({"json": schema_text}, person),
                        ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
                        ({"choice": CHOICES}, lambda t: t in CHOICES),
                        ({"grammar": GRAMMAR}, lambda t: re.fullmatch(r"\(\d{1,3}(\+\d{1,3}){0,3}\)", t))):
        for temperature, seed in ((0, None), (1.0, 4)):
            extra = {"structured_outputs": body}
            c = chat(client, temperature=temperature, seed=seed, extra_body=extra).choices[0]
            assert c.finish_reason == "stop" and check(c.message.content), (body, c.message.content)
            t = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=100, temperature=temperature,
                                          seed=seed, extra_body=extra).choices[0]
            assert t.finish_reason == "stop" and check(t.text), (body, t.text)
    streamed = client.completions.create(model=MODEL, prompt="Mail:", max_tokens=40, temperature=0, stream=True,
                                         extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, "".join(c.choices[0].text for c in streamed if c.choices))


def test_json_object(client):
    # Any object at all: nothing bounds its keys, so a random model often writes one endless key (greedy always
    # does); the seeds that close their object within the budget must give an object.
    replies = [chat(client, temperature=1.0, seed=s, max_completion_tokens=40,
                    **({"response_format": {"type": "json_object"}} if s % 2 else
                       {"extra_body": {"structured_outputs": {"json_object": True}}})).choices[0] for s in range(8)]
    done = [r for r in replies if r.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(r.message.content), dict) for r in done)
    assert all(r.message.content.startswith("{") for r in replies)


def test_max_tokens_ends_mid_object_with_length(client):
    full = chat(client, response_format=FORMAT).choices[0].message.content
    cut = chat(client, response_format=FORMAT, max_completion_tokens=10)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 10
    assert full.startswith(cut.choices[0].message.content)
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.choices[0].message.content)


def test_a_constrained_row_beside_unconstrained_ones(client, fleet):
    alone = chat(client, max_completion_tokens=12).choices[0].message.content
    with ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(chat, client, response_format=FORMAT, temperature=1.0, seed=s) for s in range(3)]
        free = [pool.submit(chat, client, max_completion_tokens=12) for _ in range(3)]
        for f in constrained:
            person(f.result().choices[0].message.content)
        assert all(f.result().choices[0].message.content == alone for f in free)
    wait_idle(fleet)


def test_adapter_rows_and_preemption_mid_object(squeezed):
    client = squeezed["client"]
    plain_adapter = chat(client, model=ADAPTER, max_completion_tokens=8).choices[0].message.content
    budget = {"max_completion_tokens": 80}      # a whole object fits; prompt + 80 tokens fit the pool alone
    jobs = [dict(model=ADAPTER, response_format=FORMAT, temperature=1.0, seed=s, **budget) for s in range(3)]
    jobs += [dict(response_format=FORMAT, temperature=1.0, seed=s, **budget) for s in range(3)]
    jobs += [dict(model=ADAPTER, extra_body={"structured_outputs": {"regex": REGEX}}, **budget)]
    jobs += [dict(model=ADAPTER, max_completion_tokens=8)]
    before = squeezed["stub"].GetModelInfo(decoder_pb2.GetModelInfoRequest()).stats.preemptions
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda kw: chat(client, **kw).choices[0], jobs))
    after = squeezed["stub"].GetModelInfo(decoder_pb2.GetModelInfoRequest()).stats.preemptions
    assert after > before
    for reply in replies[:6]:
        assert reply.finish_reason == "stop" and person(reply.message.content)
    assert re.fullmatch(REGEX, replies[6].message.content)
    assert replies[7].message.content == plain_adapter     # the adapter row is itself, beside the grammars
    # The adapter changes the model: its constrained output is not the base model's.
    base = chat(client, response_format=FORMAT, **budget).choices[0].message.content
    assert chat(client, model=ADAPTER, response_format=FORMAT, **budget).choices[0].message.content != base
    wait_idle(squeezed)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"allOf": []}}}},
     "response_format", "allOf"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "no spaces", "schema": SCHEMA}}},
     "response_format", "name"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format"),
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs", "regex does not compile"),
    ({"structured_outputs": {"regex": "(a)\\1"}}, "structured_outputs", "Backreference"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "at least one"),
    ({"structured_outputs": {"grammar": "start: \"a\""}}, "structured_outputs", "grammar does not compile"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "structured_outputs", "uniqueItems"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "json_object must be true"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, "structured_outputs", "Extra"),
    ({"response_format": FORMAT, "structured_outputs": {"regex": "a"}}, "structured_outputs", "not both"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}}, "structured_outputs",
     "not both"),
    ({"guided_json": SCHEMA}, "guided_json", "structured_outputs.json"),
    ({"guided_regex": "a+"}, "guided_regex", "structured_outputs.regex"),
    ({"guided_choice": ["a"]}, "guided_choice", "structured_outputs.choice"),
    ({"guided_grammar": "root ::= \"a\""}, "guided_grammar", "structured_outputs.grammar"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "structured_outputs"),
]


@pytest.mark.parametrize("extra, param, says", BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_bad_inputs_are_a_400_naming_the_field(fleet, extra, param, says):
    http = fleet["http"]
    for path, body in (("/v1/chat/completions", {"messages": ASK, "max_tokens": 5}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": 5})):
        reply = http.post(path, json={**body, **extra})
        assert reply.status_code == 400, reply.text
        err = reply.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and says in err["message"], err


def test_the_decoder_is_healthy_after_the_refusals(fleet, client):
    with pytest.raises(openai.BadRequestError, match="structured_outputs"):
        client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"guided_json": SCHEMA})
    with pytest.raises(openai.BadRequestError, match="does not compile"):
        client.chat.completions.create(model=MODEL, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"$ref": "#/$defs/nowhere"}}}}})
    still_up(fleet)
    person(chat(client, response_format=FORMAT).choices[0].message.content)
