"""StructuredOutput over real gRPC: a constrained Generate streams a valid answer; every refusal is
INVALID_ARGUMENT with param structured_output, before anything is queued, and the engine serves on."""
from __future__ import annotations

import json

import grpc
import pytest

from services.common.errors import PARAM_KEY, REASON_KEY
from services.common.pb import decoder_pb2, decoder_pb2_grpc
from tests.decoder.server.conftest import decoder_server, tiny_chat_model  # noqa: F401 - the fixtures

D = decoder_pb2


@pytest.fixture(scope="module")
def stub(decoder_server):  # noqa: F811
    with grpc.insecure_channel(decoder_server[0]) as channel:
        yield decoder_pb2_grpc.DecoderServiceStub(channel)


def generate(stub, structured: D.StructuredOutput, n: int = 1) -> list[str]:
    request = D.GenerateRequest(text="Answer:", sampling=D.SamplingParams(max_tokens=40, temperature=0, n=n,
                                                                          structured_output=structured))
    texts = [""] * n
    for message in stub.Generate(request):
        if message.text:
            texts[message.index] += message.text
    return texts


def test_a_constrained_generate(stub):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for text in generate(stub, D.StructuredOutput(json_schema=json.dumps(schema)), n=2):
        assert isinstance(json.loads(text)["ok"], bool)
    choices = D.StructuredOutput(choice=D.StructuredOutput.Choices(choices=["left", "right"]))
    assert generate(stub, choices)[0] in ("left", "right")


@pytest.mark.parametrize("structured, says", [
    (D.StructuredOutput(), "sets no constraint"),
    (D.StructuredOutput(json_object=False), "must be true"),
    (D.StructuredOutput(json_schema="[]"), "must be a JSON object"),
    (D.StructuredOutput(json_schema='{"type": "foo"}'), "does not compile"),
    (D.StructuredOutput(json_schema='{"oneOf": []}'), "oneOf"),
    (D.StructuredOutput(regex="(a"), "regex does not compile"),
    (D.StructuredOutput(choice=D.StructuredOutput.Choices()), "at least one"),
    (D.StructuredOutput(grammar="root ::= ("), "grammar does not compile"),
])
def test_refusals_are_invalid_argument_naming_the_field(stub, structured, says):
    with pytest.raises(grpc.RpcError) as exc:
        generate(stub, structured)
    err = exc.value
    meta = dict(err.trailing_metadata())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.details()
    assert (meta[REASON_KEY], meta[PARAM_KEY]) == ("INVALID_ARGUMENT", "structured_output")
    info = stub.GetModelInfo(D.GetModelInfoRequest()).stats
    assert info.running == 0 and info.waiting == 0
