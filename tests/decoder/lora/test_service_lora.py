"""Adapters over real gRPC: Load/List/Unload, Generate with an adapter, and every refusal.

The decoder starts with --lora pre=<folder> preloaded and --lora-root confining runtime
loads. After each refusal the adapter list is unchanged and the server keeps serving.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import grpc
import pytest
from prometheus_client import REGISTRY

from services.common.errors import REASON_KEY
from services.common.pb import decoder_pb2, decoder_pb2_grpc
from tests.decoder.lora.adapters import Spec, write_adapter
from tests.loops import LoopThread

D = decoder_pb2
PROMPT = D.TokenIds(ids=list(range(100, 121)))


@pytest.fixture(scope="module")
def lora_server(tiny_chat_model, tmp_path_factory):
    from services.decoder.server.config import DecoderConfig, DecoderServerConfig
    from services.decoder.server.service import start
    tmp = tmp_path_factory.mktemp("lora_service")
    root, outside = tmp / "root", tmp / "outside"
    good = write_adapter(tiny_chat_model, root, Spec("good", 4, 8.0, ("q_proj", "v_proj"), 31), scale=0.5)
    write_adapter(tiny_chat_model, root, Spec("good2", 8, 8.0, ("o_proj", "down_proj", "k_proj"), 32), scale=0.5)
    write_adapter(tiny_chat_model, outside, Spec("secret", 4, 8.0, ("q_proj",), 33))
    shutil.copytree(good, root / "dora")
    cfg_path = root / "dora" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "use_dora": True}))
    os.symlink(outside / "secret", root / "escape")
    loop = LoopThread()
    cfg = DecoderConfig(model=str(tiny_chat_model), num_blocks=64, block_size=4, max_num_batched_tokens=32,
                        max_loras=2, max_lora_rank=8, max_cpu_loras=4, lora_root=str(root),
                        lora=(f"pre={good}",), fast_paths="screen=on")
    server, servicer = loop.run(start(DecoderServerConfig(host="127.0.0.1", port=0), cfg))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield decoder_pb2_grpc.DecoderServiceStub(channel)
    loop.run(server.stop(0))
    assert servicer.close()    # the engine, then the grammar compiler's threads
    loop.close()


def generate(stub, adapter="", max_tokens=6):
    msgs = list(stub.Generate(D.GenerateRequest(adapter=adapter, token_ids=PROMPT, sampling=D.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))))
    return [t for m in msgs[:-1] for t in m.token_ids], msgs[-1].usage.cached_tokens


def listed(stub):
    return {a.name: a for a in stub.ListAdapters(D.ListAdaptersRequest()).adapters}


def rpc_error(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    err = info.value
    return err.code(), dict(err.trailing_metadata() or ()).get(REASON_KEY), err.details()


def wait_refs(stub, refs, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = stub.GetModelInfo(D.GetModelInfoRequest()).stats
        if s.adapter_refs == refs and s.running == 0 and s.waiting == 0:
            return
        time.sleep(0.05)
    pytest.fail(f"adapter refs did not return to {refs}")


def test_preloaded_adapter_and_model_info(lora_server):
    stub = lora_server
    info = stub.GetModelInfo(D.GetModelInfoRequest())
    assert (info.lora_backend, info.max_loras, info.max_lora_rank, info.stats.adapter_refs) == ("cpu", 2, 8, 0)
    pre = listed(stub)["pre"]
    assert (pre.rank, list(pre.target_modules), pre.slot, pre.refs, len(pre.digest)) == \
        (4, ["q_proj", "v_proj"], 0, 0, 64)
    assert stub.ListAdapters(D.ListAdaptersRequest()).base_model == info.name
    # The CPU pool's bytes: the preloaded adapter's rank-4 rows placed, within the default 1 GiB budget.
    used, allocated, budget = (REGISTRY.get_sample_value("tessera_decoder_adapter_pool_bytes", {"state": state})
                               for state in ("used", "allocated", "budget"))
    assert 0 < used <= allocated <= budget == 2**30


def test_load_generate_unload(lora_server):
    stub = lora_server
    base, _ = generate(stub)
    pre, _ = generate(stub, "pre")
    loaded = stub.LoadAdapter(D.LoadAdapterRequest(name="two", path="good2")).adapter
    assert (loaded.name, loaded.rank, list(loaded.target_modules)) == ("two", 8, ["k_proj", "o_proj", "down_proj"])
    two, _ = generate(stub, "two")
    assert len({tuple(base), tuple(pre), tuple(two)}) == 3          # each adapter changes the output
    # Same weights under another name: same digest, same output, the prompt's blocks are shared.
    same = stub.LoadAdapter(D.LoadAdapterRequest(name="pre-copy", path="./good/../good")).adapter
    assert same.digest == listed(stub)["pre"].digest
    assert generate(stub, "pre-copy") == (pre, 20)
    stub.UnloadAdapter(D.UnloadAdapterRequest(name="two"))
    stub.UnloadAdapter(D.UnloadAdapterRequest(name="pre-copy"))
    assert set(listed(stub)) == {"pre"}
    code, reason, _ = rpc_error(lambda: generate(stub, "two"))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND")
    wait_refs(stub, 0)


@pytest.mark.parametrize("name,path,code,reason,message", [
    ("x", "../outside/secret", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "outside the adapter root"),
    ("x", "escape", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "outside the adapter root"),
    ("x", "/etc", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "outside the adapter root"),
    ("x", "missing", "NOT_FOUND", "ADAPTER_NOT_FOUND", "does not exist"),
    ("x", "dora", "INVALID_ARGUMENT", "UNSUPPORTED", "DoRA"),
    ("bad name", "good", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "adapter name"),
    ("x", "", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "lora_path"),
])
def test_bad_loads_refused_nothing_written(lora_server, name, path, code, reason, message):
    stub = lora_server
    before = listed(stub)
    got = rpc_error(lambda: stub.LoadAdapter(D.LoadAdapterRequest(name=name, path=path)))
    assert (got[0].name, got[1]) == (code, reason) and message in got[2], got
    assert listed(stub) == before
    assert generate(stub, "pre")[0]           # still serving


def test_unknown_adapter_and_unload_unknown(lora_server):
    stub = lora_server
    code, reason, details = rpc_error(lambda: generate(stub, "nope"))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND") and "nope" in details
    code, reason, _ = rpc_error(lambda: stub.UnloadAdapter(D.UnloadAdapterRequest(name="nope")))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND")


def test_leased_adapter_cannot_be_replaced_or_unloaded(lora_server):
    stub = lora_server
    stub.LoadAdapter(D.LoadAdapterRequest(name="busy", path="good2"))
    call = stub.Generate(D.GenerateRequest(adapter="busy", token_ids=PROMPT, sampling=D.SamplingParams(
        temperature=0, max_tokens=200, ignore_eos=True)))
    next(call)                                   # admitted and decoding: the lease is held
    assert listed(stub)["busy"].refs == 1
    assert stub.GetModelInfo(D.GetModelInfoRequest()).stats.adapter_refs >= 1
    for attempt in (lambda: stub.LoadAdapter(D.LoadAdapterRequest(name="busy", path="good")),
                    lambda: stub.UnloadAdapter(D.UnloadAdapterRequest(name="busy"))):
        code, reason, details = rpc_error(attempt)
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "ADAPTER_IN_USE") and "busy" in details
    call.cancel()
    wait_refs(stub, 0)
    stub.UnloadAdapter(D.UnloadAdapterRequest(name="busy"))
    assert "busy" not in listed(stub)
