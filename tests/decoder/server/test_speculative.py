"""Speculative decoding over real gRPC: the flag, GetModelInfo, and streams whose text, tokens,
logprobs, stop strings and usage equal the same server without speculation."""
from __future__ import annotations

import grpc
import pytest

from services.common import config as cfg_mod
from services.common.pb import decoder_pb2, decoder_pb2_grpc
from services.decoder.server.config import ENV_PREFIX, DecoderConfig, DecoderServerConfig
from tests.decoder.model.checkpoints import TINY_SHAPE
from tests.loops import LoopThread
from tests.tolerance import assert_close

D = decoder_pb2
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
# Text that repeats, so drafts come from the prompt.
QUOTE = "Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat."


class Stubs(list):
    addresses: list[str]


@pytest.fixture(scope="module")
def servers(tiny_chat_model):
    """(plain stub, speculative stub), each a real decoder on an ephemeral port; .addresses holds theirs."""
    from services.decoder.server.service import start
    loop = LoopThread()
    started, channels = [], []
    for spec in ("", SPEC):
        cfg = DecoderConfig(model=str(tiny_chat_model), num_blocks=128, block_size=4, max_num_batched_tokens=64,
                            max_n=4, speculative_config=spec, fast_paths="screen=on,speculation=always")
        started.append(loop.run(start(DecoderServerConfig(host="127.0.0.1", port=0), cfg)))
        channels.append(grpc.insecure_channel(f"127.0.0.1:{started[-1][0].port}"))
    stubs = Stubs(decoder_pb2_grpc.DecoderServiceStub(ch) for ch in channels)
    stubs.addresses = [f"127.0.0.1:{server.port}" for server, _ in started]
    yield stubs
    for ch in channels:
        ch.close()
    for server, servicer in started:
        loop.run(server.stop(0))
        assert servicer.close()    # the engine, then the grammar compiler's threads
    loop.close()


def chat(text, **sampling):
    return D.GenerateRequest(
        chat=D.ChatMessages(messages=[D.ChatMessage(role="user", content=[D.ContentPart(text=text)])],
                            add_generation_prompt=True),
        sampling=D.SamplingParams(**sampling))


def collect(stub, req):
    """(text, token ids, logprobs, finish reason, usage) of choice 0, and how many deltas carried tokens."""
    text, ids, logprobs, reason, usage, deltas = "", [], [], None, None, 0
    for msg in stub.Generate(req):
        if msg.HasField("usage"):
            usage = msg.usage
            continue
        text += msg.text
        ids += list(msg.token_ids)
        logprobs += [lp.logprob for lp in msg.logprobs]
        deltas += bool(msg.token_ids)
        reason = msg.finish_reason or reason
    return text, ids, logprobs, reason, usage, deltas


def test_model_info_reports_the_config_and_the_counters(servers):
    plain, spec = servers
    assert not plain.GetModelInfo(D.GetModelInfoRequest()).HasField("speculative_decoding")
    info = spec.GetModelInfo(D.GetModelInfoRequest()).speculative_decoding
    assert (info.method, info.num_speculative_tokens, info.prompt_lookup_max, info.prompt_lookup_min,
            info.disable_by_batch_size) == ("ngram", 4, 3, 1, 4)


def test_the_gateway_lists_whether_speculation_is_on(servers):
    from gateway.backends import Backend
    from gateway.config import GatewayConfig

    async def listed():
        cards = []
        for address in servers.addresses:
            backend = Backend("decoder", address, GatewayConfig(decoder=(address,)))
            backend.open()
            try:
                cards.append((await backend.models())[0].extra["speculative"])
            finally:
                await backend.close()
        return cards

    loop = LoopThread()
    try:
        plain, spec = loop.run(listed())
    finally:
        loop.close()
    assert plain is None and spec["method"] == "ngram" and spec["num_speculative_tokens"] == 4


def test_streams_equal_the_server_without_speculation(servers):
    plain, spec = servers
    before = spec.GetModelInfo(D.GetModelInfoRequest()).stats
    req = chat(QUOTE, temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    want, got = collect(plain, req), collect(spec, req)
    assert got[0] == want[0] and got[1] == want[1] and got[3] == want[3] and got[4] == want[4]
    assert_close(got[2], want[2], **TINY_SHAPE)
    after = spec.GetModelInfo(D.GetModelInfoRequest()).stats
    accepted = after.accepted_tokens - before.accepted_tokens
    assert accepted > 0 and after.draft_tokens > after.accepted_tokens and after.verifications > 0
    assert got[5] < want[5]            # accepted runs arrive as fewer deltas carrying several tokens


def test_a_stop_string_ends_the_stream_and_the_count_as_without_speculation(servers):
    plain, spec = servers
    req = chat(QUOTE, temperature=0, max_tokens=40, ignore_eos=True)
    text = collect(spec, req)[0]
    stop = text[len(text) * 2 // 3:][:4]          # reached late, after runs were accepted
    req = chat(QUOTE, temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    want, got = collect(plain, req), collect(spec, req)
    assert got[0] == want[0] == text[:text.find(stop)]
    assert got[1] == want[1] and got[3] == D.FINISH_REASON_STOP
    assert got[4].completion_tokens == want[4].completion_tokens == len(got[1])


def test_seeded_sampling_and_n_choices_equal_the_server_without_speculation(servers):
    plain, spec = servers
    req = chat(QUOTE, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, n=2)
    want = sorted((m.index, tuple(m.token_ids)) for m in plain.Generate(req) if m.token_ids)
    got = sorted((m.index, tuple(m.token_ids)) for m in spec.Generate(req) if m.token_ids)
    flat = lambda pairs, i: [t for j, ids in pairs if j == i for t in ids]   # noqa: E731
    assert flat(got, 0) == flat(want, 0) and flat(got, 1) == flat(want, 1)


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
     "prompt_lookup_min (3) must be <= prompt_lookup_max (2)"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "not supported"),
    ("{not json", "not JSON"),
])
def test_bad_speculative_config_is_a_usage_error_at_start(value, message, capsys):
    with pytest.raises(SystemExit) as info:
        cfg_mod.load((DecoderServerConfig, DecoderConfig), ["--model", "/m", "--speculative-config", value],
                     prog="decoder", description="", env_prefix=ENV_PREFIX)
    assert info.value.code == 2 and message in capsys.readouterr().err
