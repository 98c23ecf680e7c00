"""DecoderService over real gRPC: health, reflection, streaming order, cancellation, every error code."""
from __future__ import annotations

import re

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.errors import REASON_KEY
from services.common.pb import decoder_pb2, decoder_pb2_grpc
from tests.decoder.idle import wait_idle

D = decoder_pb2


@pytest.fixture(scope="module")
def channel(decoder_server):
    address, _ = decoder_server
    with grpc.insecure_channel(address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return decoder_pb2_grpc.DecoderServiceStub(channel)


def chat(text, **sampling):
    return D.GenerateRequest(
        chat=D.ChatMessages(messages=[D.ChatMessage(role="user", content=[D.ContentPart(text=text)])],
                            add_generation_prompt=True),
        sampling=D.SamplingParams(**sampling))


def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "tessera.decoder.v1.DecoderService"):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
            health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert "tessera.decoder.v1.DecoderService" in names


def test_model_info(stub, tiny_chat_model):
    info = stub.GetModelInfo(D.GetModelInfoRequest())
    assert info.name == tiny_chat_model.name
    assert info.vocab_size == 49152 and info.max_model_len == 256 and info.has_chat_template
    assert list(info.eos_token_ids) == [2]
    assert info.stats.total_blocks == 64
    assert info.quantization == "none"
    # Every fast path chosen at load, one structured record each (services/common/plan.py).
    plan = {c.name: c for c in info.execution_plan.choices}
    assert info.execution_plan.pins == "screen=on"
    # The matmul path per weight shape (services/common/linear_path.py), timed at row counts.
    assert plan["linear 64x64"].chosen.startswith(("packed", "plain"))
    assert {t.candidate for t in plan["linear 64x64"].timings} <= {"plain", "packed"}
    assert plan["attention"].chosen in ("cpp", "torch")
    # Decode steps in one C++ call where that won at load (runner/fused_decode.py), timed whichever attention the
    # layers' own timing preferred; where it runs, so does the operator.
    assert re.fullmatch(r"on rows<=\d+|off", plan["decode_stack"].chosen), plan["decode_stack"]
    assert {t.candidate for t in plan["decode_stack"].timings} >= {"on", "off"}
    assert plan["attention"].chosen == "cpp" or plan["decode_stack"].chosen == "off"
    # The elementwise glue per op, timed at load (model/glue.py).
    for op in ("glue.norm", "glue.act"):
        assert plan[op].chosen in ("cpp", "torch") and {t.candidate for t in plan[op].timings} == {"cpp", "torch"}
    # Weights and KV cache in huge-page arenas (services/common/arena.py), with what the kernel granted.
    # (A kernel built without THP refuses the advice: "4 KiB pages (why)".)
    refused = r"4 KiB pages \(madvise\(MADV_HUGEPAGE\) refused: [^)]*\)"
    assert plan["huge_pages"].chosen == "on"
    assert re.fullmatch(rf"weights: one arena of \d+ MiB, (\d+ MiB in 2 MiB pages|{refused}) "
                        rf"\(transparent_hugepage=\w+\); KV cache: one arena of \d+ MiB, "
                        rf"(2 MiB pages as it is first written|{refused}) \(transparent_hugepage=\w+\)",
                        plan["huge_pages"].reason), plan["huge_pages"].reason
    # The server fixture pins the greedy argmax screen on (model/screen.py): not timed.
    assert (plan["screen"].chosen, plan["screen"].reason) == ("on", "pinned by --fast-paths screen=on")
    assert not plan["screen"].timings
    assert plan["grammar_mask"].chosen in ("unpacked", "xgrammar")


def test_stream_order_text_and_usage(stub, decoder_server):
    _, servicer = decoder_server
    msgs = list(stub.Generate(chat("Hello there", temperature=0, max_tokens=12, ignore_eos=True)))
    *deltas, last = msgs
    assert last.HasField("usage") and not last.token_ids
    assert all(not m.HasField("usage") for m in deltas)
    assert [bool(m.finish_reason) for m in deltas].count(True) == 1
    assert deltas[-1].finish_reason == D.FINISH_REASON_LENGTH
    ids = [t for m in deltas for t in m.token_ids]
    assert len(ids) == 12 == last.usage.completion_tokens
    tok = servicer.state.tokenizer
    assert "".join(m.text for m in deltas) == tok.decode(ids)
    assert last.usage.total_tokens == last.usage.prompt_tokens + 12
    wait_idle(stub)


def test_n_choices_seeded_and_logprobs(stub):
    req = chat("Count", temperature=1.0, seed=7, max_tokens=5, n=2, logprobs=3, ignore_eos=True)
    first = list(stub.Generate(req))
    again = list(stub.Generate(req))   # the prompt cached now: the choices may run in other steps than the first time

    def by_choice(messages):
        tokens = {0: [], 1: []}
        for m in messages[:-1]:
            tokens[m.index].extend(m.token_ids)
            for lp in m.logprobs:
                assert len(lp.top) == 3 and lp.logprob <= 0
        return tokens

    assert all(len(v) == 5 for v in by_choice(first).values())
    assert by_choice(first) == by_choice(again)
    assert first[-1].usage.completion_tokens == 10


def test_token_id_prompt_and_prefix_cache(stub):
    prompt = D.TokenIds(ids=list(range(100, 140)))
    req = D.GenerateRequest(token_ids=prompt, sampling=D.SamplingParams(temperature=0, max_tokens=4))
    a = list(stub.Generate(req))
    b = list(stub.Generate(req))
    assert [list(m.token_ids) for m in a[:-1]] == [list(m.token_ids) for m in b[:-1]]
    assert b[-1].usage.cached_tokens >= 32     # 8 full blocks of 4 (never the last prompt token)
    wait_idle(stub)


def test_each_choice_first_message_reports_its_prompt(stub):
    """PromptInfo on each choice's first message only: counts (cache hits the second time), and with
    prompt_logprobs one entry per prompt token, the first without a logprob; max_tokens 0 scores the prompt alone."""
    ids = list(range(200, 230))
    req = D.GenerateRequest(token_ids=D.TokenIds(ids=ids), sampling=D.SamplingParams(temperature=0, max_tokens=3,
                                                                                       n=2, ignore_eos=True))
    for cached in (False, True):
        msgs = list(stub.Generate(req))[:-1]
        for index in (0, 1):
            mine = [m for m in msgs if m.index == index]
            assert mine[0].HasField("prompt") and not any(m.HasField("prompt") for m in mine[1:])
            assert mine[0].prompt.prompt_tokens == len(ids) and not mine[0].prompt.logprobs
            assert (mine[0].prompt.cached_tokens >= 28) if cached or index else True
    scored = D.GenerateRequest(token_ids=D.TokenIds(ids=ids), sampling=D.SamplingParams(max_tokens=0,
                                                                                          prompt_logprobs=2))
    first, last = list(stub.Generate(scored))
    info = first.prompt
    assert first.finish_reason == D.FINISH_REASON_LENGTH and not first.token_ids and info.cached_tokens == 0
    assert [e.token_id for e in info.logprobs] == ids and last.usage.completion_tokens == 0
    assert info.logprobs[0].logprob == 0 and not info.logprobs[0].top and info.logprobs[0].rank == 0
    for e in info.logprobs[1:]:
        assert e.logprob <= 0 and e.rank >= 1 and len(e.top) == 2 and e.top[0].logprob >= e.top[1].logprob
        # Rank 1 is the likeliest token; a token among the top alternatives has its place there (ties aside).
        assert e.rank > 1 or e.logprob == e.top[0].logprob
        assert e.rank <= 2 or e.token_id not in [t.token_id for t in e.top]
    wait_idle(stub)


def test_cancel_frees_blocks(channel, stub):
    call = stub.Generate(chat("Tell me a long story", temperature=0, max_tokens=200, ignore_eos=True))
    got = 0
    for m in call:
        got += len(m.token_ids)
        if got >= 3:
            break
    call.cancel()
    s = wait_idle(stub)
    assert s.free_blocks == s.total_blocks


def _error(stub, req):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req))
    err = info.value
    return err.code(), dict(err.trailing_metadata() or ()).get(REASON_KEY), err.details()


@pytest.mark.parametrize("req, code, reason", [
    (D.GenerateRequest(text="", sampling=D.SamplingParams(max_tokens=2)), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    (D.GenerateRequest(sampling=D.SamplingParams(max_tokens=2)), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    (D.GenerateRequest(token_ids=D.TokenIds(ids=list(range(300)))), "INVALID_ARGUMENT", "CONTEXT_LENGTH"),
    (D.GenerateRequest(text="hi", sampling=D.SamplingParams(max_tokens=1000)), "INVALID_ARGUMENT",
     "CONTEXT_LENGTH"),
    (D.GenerateRequest(text="hi", sampling=D.SamplingParams(max_tokens=0)), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    (D.GenerateRequest(text="hi", sampling=D.SamplingParams(temperature=-0.5)), "INVALID_ARGUMENT",
     "INVALID_ARGUMENT"),
    (D.GenerateRequest(text="hi", sampling=D.SamplingParams(top_p=0)), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    (D.GenerateRequest(text="hi", sampling=D.SamplingParams(top_p=1.5)), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    (D.GenerateRequest(text="hi", sampling=D.SamplingParams(n=99)), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    (D.GenerateRequest(token_ids=D.TokenIds(ids=[5, 49152])), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    (D.GenerateRequest(token_ids=D.TokenIds(ids=[5, -1])), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    (D.GenerateRequest(text="hi", sampling=D.SamplingParams(stop=["s"] * 40)), "INVALID_ARGUMENT",
     "INVALID_ARGUMENT"),
    (D.GenerateRequest(text="hi", sampling=D.SamplingParams(stop=["x" * 1000])), "INVALID_ARGUMENT",
     "INVALID_ARGUMENT"),
    (D.GenerateRequest(chat=D.ChatMessages(messages=[D.ChatMessage(role="wizard", content=[
        D.ContentPart(text="hi")])])), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    (D.GenerateRequest(chat=D.ChatMessages()), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    (D.GenerateRequest(model="nope", text="hi"), "NOT_FOUND", "MODEL_NOT_FOUND"),
    (D.GenerateRequest(adapter="nope", text="hi"), "NOT_FOUND", "ADAPTER_NOT_FOUND"),
    (D.GenerateRequest(text="hi", images=[D.ImageInput()]), "INVALID_ARGUMENT", "UNSUPPORTED"),
    *[(D.GenerateRequest(text="hi", sampling=D.SamplingParams(max_tokens=2, **bad)), "INVALID_ARGUMENT",
       "INVALID_ARGUMENT") for bad in (
        {"logit_bias": {5: 100.5}}, {"logit_bias": {5: -101}}, {"logit_bias": {49152: 1}},
        {"logit_bias": {-1: 1}}, {"min_p": 1.5}, {"min_p": -0.1}, {"repetition_penalty": 0},
        {"repetition_penalty": -1}, {"min_tokens": -1}, {"min_tokens": 3}, {"top_k": -2},
        {"stop_token_ids": [49152]}, {"prompt_logprobs": -1}, {"prompt_logprobs": 99})],
])
def test_bad_input_is_refused_and_server_stays_up(stub, req, code, reason):
    got_code, got_reason, details = _error(stub, req)
    assert (got_code.name, got_reason) == (code, reason), details
    assert details
    wait_idle(stub)
    assert list(stub.Generate(D.GenerateRequest(text="ok", sampling=D.SamplingParams(max_tokens=1))))


def test_duplicate_live_request_id_is_refused_and_the_first_finishes(stub):
    first = stub.Generate(D.GenerateRequest(request_id="dup", text="hello", sampling=D.SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True)))
    next(first)   # the first request is live
    code, reason, _ = _error(stub, D.GenerateRequest(request_id="dup", text="hi",
                                                     sampling=D.SamplingParams(max_tokens=2)))
    assert (code.name, reason) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT")
    rest = list(first)
    assert rest[-1].usage.completion_tokens == 40
    wait_idle(stub)


def _tokenize_error(stub, req, method="Tokenize"):
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, method)(req)
    return info.value.code().name, dict(info.value.trailing_metadata() or ()).get(REASON_KEY)


def test_tokenize_equals_the_tokenizer_and_what_generate_prompts_with(stub, tiny_chat_model):
    from tokenizers import Tokenizer
    ref = Tokenizer.from_file(str(tiny_chat_model / "tokenizer.json"))
    text = "The quick brown fox, twice: the quick brown fox."
    reply = stub.Tokenize(D.TokenizeRequest(text=text, add_special_tokens=True, return_token_strs=True))
    assert list(reply.token_ids) == ref.encode(text).ids and reply.max_model_len == 256
    assert list(reply.token_strs) == [ref.id_to_token(i) for i in reply.token_ids]
    assert stub.Tokenize(D.TokenizeRequest(text="")).token_ids == []
    # The chat form is the prompt Generate runs: its usage counts exactly these ids.
    request = chat("Hello there, who are you?", max_tokens=1)
    reply = stub.Tokenize(D.TokenizeRequest(chat=request.chat))
    ids = list(reply.token_ids)
    usage = list(stub.Generate(request))[-1].usage
    assert usage.prompt_tokens == len(ids) and not reply.token_strs
    text = stub.Detokenize(D.DetokenizeRequest(token_ids=ids)).text
    assert text.startswith("<|im_start|>") and ref.encode(text, add_special_tokens=False).ids == ids
    without = stub.Tokenize(D.TokenizeRequest(chat=D.ChatMessages(messages=request.chat.messages)))
    assert list(without.token_ids) == ids[:len(without.token_ids)] and len(without.token_ids) < len(ids)


@pytest.mark.parametrize("method, req, code", [
    ("Tokenize", D.TokenizeRequest(), "INVALID_ARGUMENT"),
    ("Tokenize", D.TokenizeRequest(chat=D.ChatMessages()), "INVALID_ARGUMENT"),
    ("Tokenize", D.TokenizeRequest(chat=D.ChatMessages(messages=[D.ChatMessage(role="user", content=[
        D.ContentPart(text="look"), D.ContentPart(image_index=0)])])), "INVALID_ARGUMENT"),
    ("Tokenize", D.TokenizeRequest(model="nope", text="hi"), "NOT_FOUND"),
    ("Tokenize", D.TokenizeRequest(adapter="nope", text="hi"), "NOT_FOUND"),
    ("Detokenize", D.DetokenizeRequest(token_ids=[5, 49152]), "INVALID_ARGUMENT"),
    ("Detokenize", D.DetokenizeRequest(token_ids=[-1]), "INVALID_ARGUMENT"),
    ("Detokenize", D.DetokenizeRequest(model="nope", token_ids=[5]), "NOT_FOUND"),
])
def test_bad_tokenize_input_is_refused(stub, method, req, code):
    assert _tokenize_error(stub, req, method)[0] == code
    assert stub.Tokenize(D.TokenizeRequest(text="ok")).token_ids
