"""A huge prompt is refused from a prefix, off the event loop: a 15 MB text sent to Generate gets
CONTEXT_LENGTH within a second while another stream on the same server keeps its pace; a prompt near the
limit is still judged exactly (services/common/token_budget.py)."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from services.common.errors import REASON_KEY
from services.common.pb import decoder_pb2, decoder_pb2_grpc
from tests.decoder.idle import wait_idle

D = decoder_pb2
HUGE = "word " * 3_000_000       # 15 MB; ~3M tokens against the tiny model's 256


@pytest.fixture(scope="module")
def stub(decoder_server):
    address, _ = decoder_server
    with grpc.insecure_channel(address) as channel:
        yield decoder_pb2_grpc.DecoderServiceStub(channel)


def refusal(stub, req) -> tuple[str, str, str, float]:
    started = time.perf_counter()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req))
    took = time.perf_counter() - started
    reason = dict(info.value.trailing_metadata() or ()).get(REASON_KEY)
    return info.value.code().name, reason, info.value.details(), took


def test_a_fifteen_megabyte_prompt_is_refused_at_once_without_stalling_a_stream(stub):
    stream = stub.Generate(D.GenerateRequest(text="Tell me a story", sampling=D.SamplingParams(
        temperature=0, max_tokens=120, ignore_eos=True)))
    arrivals: list[float] = []

    def read() -> None:
        for _ in stream:
            arrivals.append(time.perf_counter())
    reader = threading.Thread(target=read)
    reader.start()
    while len(arrivals) < 3:       # the stream runs
        time.sleep(0.01)
    for req in (D.GenerateRequest(text=HUGE, sampling=D.SamplingParams(max_tokens=1)),
                D.GenerateRequest(chat=D.ChatMessages(messages=[D.ChatMessage(
                    role="user", content=[D.ContentPart(text=HUGE)])], add_generation_prompt=True),
                    sampling=D.SamplingParams(max_tokens=1))):
        code, reason, details, took = refusal(stub, req)
        assert (code, reason) == ("INVALID_ARGUMENT", "CONTEXT_LENGTH"), details
        assert "at least" in details and "maximum context length is 256" in details
        assert took < 1.5, took
    reader.join(timeout=60)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert len(arrivals) == 121 and max(gaps) < 0.5, max(gaps)   # 120 deltas and the usage message
    wait_idle(stub)


def test_prompts_near_the_limit_are_judged_exactly(stub, decoder_server):
    _, servicer = decoder_server
    tok = servicer.state.tokenizer
    # Over 8 characters per token of the limit, so a prefix is tried first, yet ~60 tokens: answered whole.
    long_fits = ("-" * 200 + " x ") * 12
    assert len(long_fits) > 8 * 256 and len(tok.encode(long_fits)) < 256
    out = list(stub.Generate(D.GenerateRequest(text=long_fits, sampling=D.SamplingParams(max_tokens=1))))
    assert out[-1].usage.prompt_tokens == len(tok.encode(long_fits))
    text = "x" + " x" * 254                   # 255 tokens: room for one more
    assert len(tok.encode(text)) == 255
    out = list(stub.Generate(D.GenerateRequest(text=text, sampling=D.SamplingParams(max_tokens=1))))
    assert out[-1].usage.prompt_tokens == 255
    _, reason, details, _ = refusal(stub, D.GenerateRequest(text=text + " x", sampling=D.SamplingParams(
        max_tokens=1)))
    assert reason == "CONTEXT_LENGTH" and "has 256 tokens" in details, details
    wait_idle(stub)
