"""The decoder's rulebook (services/decoder/server/validation.py), without a server: each rule refuses with its
field named, and the limits it publishes are the config's numbers."""
from __future__ import annotations

import grpc
import pytest

from services.common.errors import ContextLengthExceeded, InvalidArgument, TooLarge
from services.common.pb import decoder_pb2, decoder_pb2_grpc
from services.decoder.server.config import DecoderConfig
from services.decoder.server.validation import (
    Limits,
    check_images,
    check_messages,
    check_prompt,
    check_tools,
    sampling_params,
)

LIMITS = Limits(max_images=2, max_image_bytes=1000, max_n=4, max_logprobs=5, max_model_len=64)


def test_limits_come_from_the_config_and_travel_as_request_limits():
    cfg = DecoderConfig(model="m", max_images=3, max_image_bytes=1234, max_n=7, max_logprobs=9)
    limits = Limits.of(cfg, max_model_len=256)
    assert limits.to_proto() == decoder_pb2.RequestLimits(
        max_images=3, max_image_bytes=1234, max_n=7, max_logprobs=9, max_model_len=256, max_stop_strings=16,
        max_stop_string_chars=256, max_tools=128, max_logit_bias=1024)
    with pytest.raises(ValueError, match="max_image_bytes must be at least 1"):
        DecoderConfig(model="m", max_image_bytes=0)


def test_image_count_past_the_limit_is_too_large():
    check_images(2, LIMITS)
    with pytest.raises(TooLarge, match="3 images in one request; at most 2 per request") as exc:
        check_images(3, LIMITS)
    assert exc.value.param == "images"


def test_tool_and_logit_bias_counts_past_the_limit_are_too_large():
    limits = Limits(max_images=2, max_image_bytes=1000, max_n=4, max_logprobs=5, max_model_len=64, max_tools=3,
                    max_logit_bias=2)
    check_tools(3, limits)
    with pytest.raises(TooLarge, match="4 tools in one request; at most 3 per request") as exc:
        check_tools(4, limits)
    assert exc.value.param == "tools"
    sampling_params(_sampling(logit_bias={1: 1.0, 2: 1.0}), prompt_len=10, vocab_size=100, limits=limits)
    with pytest.raises(TooLarge, match="logit_bias has 3 entries; at most 2 per request") as exc:
        sampling_params(_sampling(logit_bias={1: 1.0, 2: 1.0, 3: 1.0}), prompt_len=10, vocab_size=100,
                        limits=limits)
    assert exc.value.param == "logit_bias"
    with pytest.raises(ValueError, match="max_tools must be at least 1"):
        DecoderConfig(model="m", max_tools=0)


def test_prompt_must_be_non_empty_and_leave_room_for_output():
    check_prompt([1] * 63, LIMITS)
    with pytest.raises(InvalidArgument, match="empty") as exc:
        check_prompt([], LIMITS)
    assert exc.value.param == "prompt"
    with pytest.raises(ContextLengthExceeded, match="64 tokens; the maximum context length is 64"):
        check_prompt([1] * 64, LIMITS)


def _chat(*messages: decoder_pb2.ChatMessage) -> decoder_pb2.ChatMessages:
    return decoder_pb2.ChatMessages(messages=messages)


def _text(text: str) -> list[decoder_pb2.ContentPart]:
    return [decoder_pb2.ContentPart(text=text)]


CALL = decoder_pb2.ToolCall(id="a", name="f", arguments="{}")


@pytest.mark.parametrize("messages, says", [
    ([], "must not be empty"),
    ([decoder_pb2.ChatMessage(role="user", content=_text("x"), tool_calls=[CALL])], "only assistant"),
    ([decoder_pb2.ChatMessage(role="tool", content=_text("x"))], "need a tool_call_id"),
    ([decoder_pb2.ChatMessage(role="user", content=_text("x"), tool_call_id="a")], "only tool messages"),
    ([decoder_pb2.ChatMessage(role="assistant")], "content is required"),
    ([decoder_pb2.ChatMessage(role="user", content=_text("x")),
      decoder_pb2.ChatMessage(role="tool", content=_text("21"), tool_call_id="a")], "answers no tool call"),
    ([decoder_pb2.ChatMessage(role="tool", content=_text("21"), tool_call_id="a"),
      decoder_pb2.ChatMessage(role="assistant", tool_calls=[CALL])], "answers no tool call of an earlier"),
])
def test_role_rules_name_the_message(messages, says):
    with pytest.raises(InvalidArgument, match=says) as exc:
        check_messages(_chat(*messages))
    assert exc.value.param == "messages"


def test_a_call_and_its_answer_pass():
    check_messages(_chat(decoder_pb2.ChatMessage(role="user", content=_text("weather?")),
                         decoder_pb2.ChatMessage(role="assistant", tool_calls=[CALL]),
                         decoder_pb2.ChatMessage(role="tool", content=_text("21"), tool_call_id="a")))


def _sampling(**fields) -> decoder_pb2.SamplingParams:
    return decoder_pb2.SamplingParams(**fields)


@pytest.mark.parametrize("fields, param, says", [
    (dict(temperature=-0.1), "temperature", r"\[0, 100\]"),
    (dict(temperature=float("nan")), "temperature", "finite"),
    (dict(top_p=0.0), "top_p", r"\(0, 1\]"),
    (dict(top_k=-2), "top_k", "-1, 0"),
    (dict(min_p=1.5), "min_p", r"\[0, 1\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "> 0"),
    (dict(n=5), "n", "between 1 and 4"),
    (dict(n=0), "n", "between 1 and 4"),
    (dict(max_tokens=0), "max_tokens", "at least 1"),
    (dict(logprobs=6), "logprobs", "between 0 and 5"),
    (dict(prompt_logprobs=6), "prompt_logprobs", "between 0 and 5"),
    (dict(prompt_logprobs=-1), "prompt_logprobs", "between 0 and 5"),
    (dict(max_tokens=-1, prompt_logprobs=0), "max_tokens", "at least 0"),
    (dict(presence_penalty=2.5), "presence_penalty", r"\[-2, 2\]"),
    (dict(stop_token_ids=[100]), "stop_token_ids", r"\[0, 100\)"),
    (dict(max_tokens=3, min_tokens=4), "min_tokens", r"max_tokens \(3\)"),
    (dict(logit_bias={100: 1.0}), "logit_bias", "outside the vocabulary"),
    (dict(logit_bias={5: 101.0}), "logit_bias", r"\[-100, 100\]"),
    (dict(stop=["x"] * 17), "stop", "at most 16"),
])
def test_sampling_ranges_are_refused_naming_the_field(fields, param, says):
    with pytest.raises(InvalidArgument, match=says) as exc:
        sampling_params(_sampling(**fields), prompt_len=10, vocab_size=100, limits=LIMITS)
    assert exc.value.param == param


def test_a_scored_prompt_may_generate_nothing():
    params, _ = sampling_params(_sampling(max_tokens=0, prompt_logprobs=2), prompt_len=10, vocab_size=100,
                                limits=LIMITS)
    assert (params.max_tokens, params.prompt_logprobs, params.logprobs) == (0, 2, None)


def test_sampling_defaults_fill_the_context():
    params, include_stop = sampling_params(_sampling(), prompt_len=10, vocab_size=100, limits=LIMITS)
    assert (params.temperature, params.top_p, params.n, params.max_tokens, params.logprobs) == (1.0, 1.0, 1, 54, None)
    assert include_stop is False
    params, _ = sampling_params(_sampling(n=4, logprobs=5, top_k=-1, logit_bias={7: -100.0, 3: 2.0}),
                                prompt_len=63, vocab_size=100, limits=LIMITS)
    assert (params.n, params.logprobs, params.top_k, params.max_tokens) == (4, 5, 0, 1)
    assert params.logit_bias == ((3, 2.0), (7, -100.0))


def test_the_server_publishes_its_limits_and_judges_by_them(decoder_server):
    """GetModelInfo.limits are the numbers Generate refuses by (the gateway reads them from there)."""
    address, _ = decoder_server
    with grpc.insecure_channel(address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        limits = stub.GetModelInfo(decoder_pb2.GetModelInfoRequest(), timeout=10).limits
        assert limits == decoder_pb2.RequestLimits(max_images=8, max_image_bytes=10 * 2**20, max_n=4, max_logprobs=20,
                                                   max_model_len=256, max_stop_strings=16, max_stop_string_chars=256,
                                                   max_tools=128, max_logit_bias=1024)
        refusals = [
            (decoder_pb2.GenerateRequest(text="hi", sampling=_sampling(n=limits.max_n + 1)),
             f"between 1 and {limits.max_n}"),
            (decoder_pb2.GenerateRequest(text="hi", sampling=_sampling(logprobs=limits.max_logprobs + 1)),
             f"between 0 and {limits.max_logprobs}"),
            (decoder_pb2.GenerateRequest(chat=_chat(decoder_pb2.ChatMessage(role="user", content=_text("hi"))),
                                         images=[decoder_pb2.ImageInput()] * (limits.max_images + 1)),
             f"at most {limits.max_images} per request"),
            (decoder_pb2.GenerateRequest(chat=_chat(decoder_pb2.ChatMessage(role="tool", content=_text("21")))),
             "need a tool_call_id"),
        ]
        for request, says in refusals:
            with pytest.raises(grpc.RpcError) as exc:
                list(stub.Generate(request, timeout=10))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in exc.value.details(), \
                exc.value.details()
        answered = list(stub.Generate(decoder_pb2.GenerateRequest(text="hi", sampling=_sampling(max_tokens=2)),
                                      timeout=30))
        assert answered[-1].usage.completion_tokens == 2
