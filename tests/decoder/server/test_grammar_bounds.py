"""Grammar compilation bounded over real gRPC: a crafted slow regex is refused (INVALID_ARGUMENT naming
structured_output) at the compile deadline while a json_object request and a plain one beside it answer
promptly; a repeat is refused at once; oversize schemas, regexes, grammars and choice lists are refused
(TOO_LARGE, 413 through the gateway) before they are parsed."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.common.errors import PARAM_KEY, REASON_KEY
from services.common.pb import decoder_pb2, decoder_pb2_grpc
from services.decoder.grammar.spec import GrammarSpec
from tests.decoder.server.conftest import tiny_chat_model  # noqa: F401 - the fixture
from tests.loops import LoopThread

D = decoder_pb2
DEADLINE = 0.5
SLOW = "[^0-9]{1,999}[0-9]{1,999}"   # 25 bytes, seconds to compile (tests/decoder/grammar/test_bounds.py)


@pytest.fixture(scope="module")
def stub(tiny_chat_model):  # noqa: F811
    from services.decoder.server.config import DecoderConfig, DecoderServerConfig
    from services.decoder.server.service import start
    loop = LoopThread()
    cfg = DecoderConfig(model=str(tiny_chat_model), num_blocks=64, block_size=4, max_num_batched_tokens=32,
                        fast_paths="screen=on", grammar_threads=1, grammar_compile_timeout_s=DEADLINE,
                        max_schema_bytes=512, max_regex_bytes=64, max_grammar_bytes=128)
    server, servicer = loop.run(start(DecoderServerConfig(host="127.0.0.1", port=0), cfg))
    servicer.state.grammars.compile_now(GrammarSpec.json_object())     # the vocabulary is built
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield decoder_pb2_grpc.DecoderServiceStub(channel)
    loop.run(server.stop(0))
    # The written-off slow compile runs on to its end: wait for it, or the process aborts on exit.
    assert servicer.close(timeout=60)
    loop.close()


def generate(stub, structured: D.StructuredOutput | None = None) -> tuple[str, float]:
    """(text, seconds) of a greedy 8-token Generate."""
    sampling = D.SamplingParams(max_tokens=8, temperature=0)
    if structured is not None:
        sampling.structured_output.CopyFrom(structured)
    start = time.monotonic()
    text = "".join(m.text for m in stub.Generate(D.GenerateRequest(text="Answer:", sampling=sampling)))
    return text, time.monotonic() - start


def refused(stub, structured: D.StructuredOutput) -> tuple[grpc.RpcError, float]:
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as exc:
        generate(stub, structured)
    return exc.value, time.monotonic() - start


def test_a_slow_regex_is_refused_at_the_deadline_while_others_answer(stub):
    with ThreadPoolExecutor(3) as pool:
        slow = pool.submit(refused, stub, D.StructuredOutput(regex=SLOW))
        time.sleep(0.1)                    # the slow compile holds the only compile thread
        json_object = pool.submit(generate, stub, D.StructuredOutput(json_object=True))
        plain = pool.submit(generate, stub)
        (text, took_json), (_, took_plain) = json_object.result(timeout=30), plain.result(timeout=30)
        err, took = slow.result(timeout=30)
    meta = dict(err.trailing_metadata())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "did not compile within 0.5 s" in err.details()
    assert (meta[REASON_KEY], meta[PARAM_KEY]) == ("INVALID_ARGUMENT", "structured_output")
    assert took < DEADLINE + 1.5, took
    assert took_json < 1.5 and took_plain < 1.5, (took_json, took_plain)
    assert text.startswith("{"), text
    # The same regex again: refused without a compile.
    err, took = refused(stub, D.StructuredOutput(regex=SLOW))
    assert "did not compile within" in err.details() and took < 0.3, took
    # A new constraint still compiles (the written-off thread was replaced).
    text, _ = generate(stub, D.StructuredOutput(regex="[0-9]{3}"))
    assert text.isdigit() and len(text) == 3, text


@pytest.mark.parametrize("structured, says", [
    (D.StructuredOutput(json_schema=json.dumps({"type": "object", "description": "x" * 600})),
     "JSON schema has 6"),
    (D.StructuredOutput(regex="a" * 65), "regex has 65 bytes; structured outputs take at most 64"),
    (D.StructuredOutput(regex="é" * 33), "regex has 66 bytes"),
    (D.StructuredOutput(grammar='root ::= "' + "a" * 130 + '"'), "grammar has 14"),
    (D.StructuredOutput(choice=D.StructuredOutput.Choices(choices=["y" * 100, "n" * 29])), "choice list has 129"),
])
def test_oversize_constraints_are_too_large_naming_the_field(stub, structured, says):
    err, took = refused(stub, structured)
    meta = dict(err.trailing_metadata())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.details(), err.details()
    assert (meta[REASON_KEY], meta[PARAM_KEY]) == ("TOO_LARGE", "structured_output")
    assert "--max-" in err.details() and took < 1.0
