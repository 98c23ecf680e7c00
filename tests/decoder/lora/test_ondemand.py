"""Adapters loaded on first use by name from --lora-root (--lora-on-demand), over real gRPC.

The decoder starts with `pre` preloaded (the same folder as the on-demand `good`), room for two
more registered adapters (--max-cpu-loras 3), and a root holding good adapters, a DoRA one, a corrupt
one, a folder that is no adapter and a symlink leading out. Each test unloads what it loaded.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import REGISTRY
from safetensors.torch import load_file, save_file

from services.common.pb import decoder_pb2, decoder_pb2_grpc
from tests.decoder.lora.adapters import Spec, write_adapter
from tests.decoder.lora.test_service_lora import PROMPT, generate, listed, rpc_error, wait_refs
from tests.loops import LoopThread

D = decoder_pb2


MANY = 24      # adapters under root/many, named many/00 ...


def write_many(like: Path, out: Path, count: int) -> None:
    """`count` adapters shaped as `like` with random weights of their own, as out/00, out/01, ..."""
    tensors = load_file(like / "adapter_model.safetensors")
    gen = torch.Generator().manual_seed(7)
    for i in range(count):
        folder = out / f"{i:02d}"
        folder.mkdir(parents=True)
        shutil.copy(like / "adapter_config.json", folder)
        save_file({k: 0.5 * torch.randn(t.shape, generator=gen) for k, t in tensors.items()},
                  folder / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    """(stub, loop, on_demand): the decoder, its event loop and its OnDemand loader."""
    from services.decoder.server.config import DecoderConfig, DecoderServerConfig
    from services.decoder.server.service import start
    tmp = tmp_path_factory.mktemp("ondemand")
    root, outside = tmp / "root", tmp / "outside"
    good = write_adapter(tiny_chat_model, root, Spec("good", 4, 8.0, ("q_proj", "v_proj"), 41), scale=0.5)
    for i, name in enumerate(("two", "three", "four")):
        write_adapter(tiny_chat_model, root, Spec(name, 2 + 2 * i, 8.0, ("o_proj", "k_proj"), 42 + i), scale=0.5)
    write_adapter(tiny_chat_model, outside, Spec("secret", 4, 8.0, ("q_proj",), 49))
    shutil.copytree(good, root / "dora")
    cfg_path = root / "dora" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "use_dora": True}))
    shutil.copytree(good, root / "broken")
    (root / "broken" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    (root / "plain").mkdir()
    write_many(root / "two", root / "many", MANY)
    os.symlink(outside / "secret", root / "escape")
    loop = LoopThread()
    cfg = DecoderConfig(model=str(tiny_chat_model), num_blocks=64, block_size=4, max_num_batched_tokens=32,
                        max_loras=2, max_lora_rank=8, max_cpu_loras=3, lora_root=str(root),
                        lora=(f"pre={good}",), lora_on_demand=True, fast_paths="screen=on")
    srv, servicer = loop.run(start(DecoderServerConfig(host="127.0.0.1", port=0), cfg))
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        yield decoder_pb2_grpc.DecoderServiceStub(channel), loop, servicer.state.adapters.on_demand
    loop.run(srv.stop(0))
    assert servicer.close()    # the engine, then the grammar compiler's threads
    loop.close()


@pytest.fixture
def stub(server):
    """The stub; afterwards every adapter but `pre` is unloaded again."""
    stub, _, on_demand = server
    read = on_demand.read
    yield stub
    on_demand.read = read
    wait_refs(stub, 0)
    for name in set(listed(stub)) - {"pre"}:
        stub.UnloadAdapter(D.UnloadAdapterRequest(name=name))


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def in_thread(fn):
    """Start fn() on a thread; the returned function joins it and returns fn's result (or raises)."""
    box = {}

    def body():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the joiner
            box["error"] = exc
    thread = threading.Thread(target=body, daemon=True)
    thread.start()

    def join(timeout=60):
        thread.join(timeout)
        assert not thread.is_alive(), "the call did not finish"
        if "error" in box:
            raise box["error"]
        return box["value"]
    join.thread = thread
    return join


def gated(on_demand, names=None):
    """Make on_demand's reads of `names` (all when None) wait for the returned `go` event; `started` is
    set as a read begins, `calls` lists the folders read."""
    read, go, started, calls = on_demand.read, threading.Event(), threading.Event(), []

    def slow_read(folder):
        calls.append(folder.name)
        if names is None or folder.name in names:
            started.set()
            assert go.wait(60)
        return read(folder)
    on_demand.read = slow_read
    return go, started, calls


def wait_for(cond, timeout=20):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.01)


@contextmanager
def pinned(loop, on_demand, name):
    """As a request in flight on `name` holds it (the request path's own pin), until the block exits."""
    entered, release = threading.Event(), threading.Event()

    async def hold():
        async with on_demand.use(name):
            entered.set()
            while not release.is_set():
                await asyncio.sleep(0.01)
    done = asyncio.run_coroutine_threadsafe(hold(), loop.loop)
    assert entered.wait(30)
    try:
        yield
    finally:
        release.set()
        done.result(30)


def test_cold_adapter_loads_and_matches_the_preloaded_one(stub, caplog):
    loads, seconds = metric("tessera_decoder_adapter_on_demand_loads_total", result="loaded"), \
        metric("tessera_decoder_adapter_load_seconds_count")
    caplog.set_level("INFO", logger="tessera.decoder.lora")
    assert "good" not in listed(stub)
    tokens, _ = generate(stub, "good")
    assert tokens == generate(stub, "pre")[0] != generate(stub)[0]
    info = listed(stub)["good"]
    assert (info.rank, info.digest) == (4, listed(stub)["pre"].digest)
    assert "loaded adapter good on demand in" in caplog.text
    assert metric("tessera_decoder_adapter_on_demand_loads_total", result="loaded") == loads + 1
    assert metric("tessera_decoder_adapter_load_seconds_count") == seconds + 1
    assert generate(stub, "good")[0] == tokens              # registered now: no second load
    assert metric("tessera_decoder_adapter_on_demand_loads_total", result="loaded") == loads + 1


def test_concurrent_requests_share_one_load(stub, server):
    _, _, on_demand = server
    go, started, calls = gated(on_demand)
    joins = [in_thread(lambda: generate(stub, "two")) for _ in range(4)]
    assert started.wait(30)
    wait_for(lambda: on_demand._pins.get("two") == 4)          # all four wait on the one load
    info = stub.GetModelInfo(D.GetModelInfoRequest()).stats
    assert (info.running, info.waiting) == (0, 0)             # ...holding nothing in the engine
    go.set()
    results = [j() for j in joins]
    assert calls == ["two"] and all(r[0] == results[0][0] for r in results)


def test_a_request_whose_adapter_loads_holds_no_seat_and_no_kv(stub, server):
    """While its adapter's read runs, the request is nowhere in the engine: no running or waiting seat, no
    lease, every KV block free; a base request admitted meanwhile is the engine's only request (its blocks the
    only ones held) and completes before the load ends."""
    _, _, on_demand = server
    go, started, _ = gated(on_demand, {"three"})
    cold = in_thread(lambda: generate(stub, "three"))
    assert started.wait(30)
    wait_for(lambda: on_demand._pins.get("three") == 1)

    def stats():
        return stub.GetModelInfo(D.GetModelInfoRequest()).stats

    def idle(s):
        return (s.running, s.waiting, s.adapter_refs, s.free_blocks) == (0, 0, 0, s.total_blocks)
    assert idle(before := stats()), before
    base = stub.Generate(D.GenerateRequest(token_ids=PROMPT, sampling=D.SamplingParams(
        temperature=0, max_tokens=96, ignore_eos=True)))
    first = next(base)                                       # the base request is in the engine now
    during = stats()
    tokens = [*first.token_ids, *(t for m in base for t in m.token_ids)]
    assert (during.running, during.waiting, during.adapter_refs) == (1, 0, 0), during
    assert 0 < during.total_blocks - during.free_blocks <= -(-(len(PROMPT.ids) + 96) // 4), during
    assert len(tokens) == 96 and cold.thread.is_alive()
    assert idle(after := stats()), after
    go.set()
    assert cold()[0] and "three" in listed(stub)


def test_a_hot_adapter_does_not_wait_for_a_cold_load(stub, server):
    _, _, on_demand = server
    go, started, _ = gated(on_demand, {"three"})
    cold = in_thread(lambda: generate(stub, "three"))
    assert started.wait(30)
    t0 = time.monotonic()
    assert generate(stub, "pre")[0] and generate(stub)[0]
    assert cold.thread.is_alive() and time.monotonic() - t0 < 30
    go.set()
    assert cold()[0]
    assert "three" in listed(stub)


@pytest.mark.parametrize("name,code,reason,message", [
    ("missing", "NOT_FOUND", "ADAPTER_NOT_FOUND", "no adapter folder 'missing'"),
    ("plain", "NOT_FOUND", "ADAPTER_NOT_FOUND", "no adapter folder 'plain'"),
    ("escape", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "outside the adapter root"),
    ("good/../../outside/secret", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "outside the adapter root"),
    ("../outside/secret", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "adapter name"),
    ("dora", "INVALID_ARGUMENT", "UNSUPPORTED", "DoRA"),
    ("broken", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "cannot be read"),
])
def test_a_refused_load_fails_only_its_request(stub, name, code, reason, message):
    before = listed(stub)
    hot = in_thread(lambda: generate(stub, "pre"))
    got = rpc_error(lambda: generate(stub, name))
    assert (got[0].name, got[1]) == (code, reason) and message in got[2] and "\n" not in got[2], got
    assert hot()[0] and generate(stub, "pre")[0]             # the others ran, and it still serves
    assert listed(stub) == before


def test_tokenize_needs_the_folder_not_a_load(stub):
    ids = stub.Tokenize(D.TokenizeRequest(adapter="four", text="hello there")).token_ids
    assert list(ids) == list(stub.Tokenize(D.TokenizeRequest(text="hello there")).token_ids)
    assert "four" not in listed(stub)
    code, reason, _ = rpc_error(lambda: stub.Tokenize(D.TokenizeRequest(adapter="missing", text="x")))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND")


def test_a_full_registry_evicts_the_least_recently_used_idle_on_demand_adapter(stub, server):
    _, loop, on_demand = server
    evictions = metric("tessera_decoder_adapter_on_demand_evictions_total")
    generate(stub, "two")
    generate(stub, "three")                                  # pre + two on-demand: full
    generate(stub, "two")                                    # three is now the least recently used
    generate(stub, "four")
    assert set(listed(stub)) == {"pre", "two", "four"}       # the preloaded one is never a candidate
    assert metric("tessera_decoder_adapter_on_demand_evictions_total") == evictions + 1
    with pinned(loop, on_demand, "two"), pinned(loop, on_demand, "four"):
        code, reason, details = rpc_error(lambda: generate(stub, "three"))
        assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED"), details
        assert "registry is full" in details and "--max-cpu-loras" in details
        assert "three" not in listed(stub)
    assert generate(stub, "three")[0]
    assert set(listed(stub)) == {"pre", "two", "three"}      # four's hold ended first


def test_an_operator_loaded_adapter_is_never_evicted(stub):
    stub.LoadAdapter(D.LoadAdapterRequest(name="two", path="two"))     # the operator's, under a cold name
    generate(stub, "three")                                  # pre + two + three: full
    assert generate(stub, "four")[0]                         # evicts three, the one on-demand adapter
    assert set(listed(stub)) == {"pre", "two", "four"}
    stub.LoadAdapter(D.LoadAdapterRequest(name="four", path="four"))   # taken over by the operator
    code, reason, _ = rpc_error(lambda: generate(stub, "three"))
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED")


def test_on_demand_needs_the_root(tiny_chat_model):
    from services.decoder.server.config import DecoderConfig
    with pytest.raises(ValueError, match="lora_on_demand"):
        DecoderConfig(model=str(tiny_chat_model), lora_on_demand=True)


def test_many_adapters_cycle_through_a_small_registry(stub):
    """Two clients walk 24 adapters on disk with room for two registered: every request is served, each
    cold name is loaded once per walk, and the registry never grows past --max-cpu-loras."""
    loads = metric("tessera_decoder_adapter_on_demand_loads_total", result="loaded")
    names = [f"many/{i:02d}" for i in range(MANY)]
    outputs = {}

    def walk(part):
        for name in part:
            outputs[name] = generate(stub, name, max_tokens=3)[0]
            assert len(listed(stub)) <= 3
    joins = [in_thread(lambda part=part: walk(part)) for part in (names[::2], names[1::2])]
    for join in joins:
        join()
    assert metric("tessera_decoder_adapter_on_demand_loads_total", result="loaded") == loads + MANY
    assert len(set(map(tuple, outputs.values()))) > MANY // 2      # their own weights, mostly their own tokens
    assert generate(stub, names[0], max_tokens=3)[0] == outputs[names[0]]   # reloaded alike
