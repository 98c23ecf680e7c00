"""Bounded compilation: a compile past the deadline fails its request at once and is refused at once when
asked again, its thread is replaced (up to a bound) so other compiles go on, json_object is always ready,
and the cache stays under its byte bound."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import pytest

from services.common.errors import InvalidArgument, Overloaded
from services.decoder.grammar.cache import FutureCache
from services.decoder.grammar.compiler import GrammarCompiler
from services.decoder.grammar.pool import CompilePool
from services.decoder.grammar.spec import PARAM, GrammarSpec
from tests.decoder.grammar.conftest import EOS, VOCAB

# 14 characters that take xgrammar seconds (one grammar state per repetition, each with a token-mask pass
# over the 49k vocabulary): what a size limit alone cannot stop.
SLOW = "[^0-9]{1,999}[0-9]{1,999}"   # 25 bytes, ~1.8 s to compile on a Zen 4 (a {1,N} class alone: ~0.4 s)
DEADLINE = 0.3
BOUND = 2 << 20


@pytest.fixture(scope="module")
def bounded(tokenizer):
    c = GrammarCompiler(tokenizer.backend, vocab_size=VOCAB, stop_token_ids=(EOS,),
                        special_token_ids=tokenizer.all_special_ids, threads=1, deadline_s=DEADLINE,
                        cache_bytes=BOUND)
    c.compile_now(GrammarSpec.regex("warm"))
    yield c
    c.close()


def test_a_slow_compile_is_refused_at_the_deadline_while_others_compile(bounded):
    async def timed(spec):
        start = time.monotonic()
        try:
            result = await bounded.compile(spec)
        except InvalidArgument as exc:
            result = exc
        return result, time.monotonic() - start

    async def main():
        slow = asyncio.ensure_future(timed(GrammarSpec.regex(SLOW)))
        await asyncio.sleep(0.05)     # the slow one holds the only compile thread
        others = await asyncio.gather(timed(GrammarSpec.json_object()), timed(GrammarSpec.regex("[0-9]{3}x")))
        return await slow, others

    (error, took), others = asyncio.run(main())
    assert isinstance(error, InvalidArgument) and error.param == PARAM, error
    assert "did not compile within 0.3 s" in error.message and took < DEADLINE + 1.0, (error, took)
    # json_object was compiled and pinned at start; the new regex got the written-off thread's replacement.
    for grammar, waited in others:
        assert grammar.spec.kind in ("json_object", "regex") and waited < DEADLINE + 1.0, (grammar, waited)
    # Asked again, it is refused without a compile.
    start = time.monotonic()
    future, hit = bounded.submit(GrammarSpec.regex(SLOW))
    assert future.done() and not hit and time.monotonic() - start < 0.05
    with pytest.raises(InvalidArgument, match="did not compile within"):
        future.result()
    assert bounded.pool.written_off >= 1


def test_the_cache_stays_under_its_byte_bound(bounded):
    specs = [GrammarSpec.regex(f"[a-z]{{1,{n}}}b") for n in range(20, 32)]
    weights = []
    for spec in specs:
        grammar = bounded.compile_now(spec)
        weights.append(grammar.compiled.memory_size_bytes)
        assert bounded.cache.nbytes <= BOUND
    assert sum(weights) > BOUND, weights          # the bound did bind
    assert len(bounded.cache) < len(specs) + 2       # + json_object and the warm-up regex
    # The pinned json_object was never evicted.
    assert bounded.submit(GrammarSpec.json_object())[1] is True


def test_future_cache_evicts_by_bytes_and_keeps_pinned():
    cache = FutureCache(100, max_bytes=10, weigh=len)

    def done(value):
        def start():
            f = Future()
            f.set_result(value)
            return f
        return start

    cache.get_or_start("pin", done("pp"), pin=True)
    cache.get_or_start("a", done("aaaa"))
    cache.get_or_start("b", done("bbbb"))
    assert cache.nbytes == 10 and len(cache) == 3
    cache.get_or_start("c", done("ccc"))                 # evicts a (least recent), not the pinned one
    assert cache.nbytes == 9 and cache.get_or_start("a", done("aaaa"))[1] is False
    assert cache.get_or_start("pin", done("xx"))[1] is True
    cache.get_or_start("huge", done("h" * 11))           # heavier than the bound alone: used, not kept
    assert cache.get_or_start("huge", done("h" * 11))[1] is False and cache.nbytes == 9


def test_written_off_threads_are_replaced_up_to_a_bound():
    release = threading.Event()
    pool = CompilePool(1, 0.1, lambda job: InvalidArgument("late", param=PARAM), max_overdue=1)

    def stuck(i):
        release.wait(5)
        return i

    first, second, third = (pool.submit(stuck, i) for i in range(3))
    with pytest.raises(InvalidArgument):
        first.result(timeout=1)           # written off; a replacement takes the second
    with pytest.raises(InvalidArgument):
        second.result(timeout=1)          # written off too; 2 > max_overdue: no replacement
    time.sleep(0.3)
    assert third.started is None and pool.overdue == 2
    release.set()                         # the written-off threads end; the owed replacement starts
    assert third.result(timeout=2) == 2
    deadline = time.monotonic() + 2
    while pool.overdue and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.overdue == 0 and pool.submit(lambda: "ok").result(timeout=1) == "ok"
    pool.close()


def test_a_compile_no_thread_takes_within_the_deadline_is_overloaded(tokenizer):
    # No replacement for a written-off thread (max_overdue 0): what queues behind it is answered, not held.
    c = GrammarCompiler(tokenizer.backend, vocab_size=VOCAB, stop_token_ids=(EOS,), threads=1, deadline_s=0.2,
                        max_overdue=0)
    c.compile_now(GrammarSpec.regex("warm"))
    release = threading.Event()
    c._compile = lambda spec: release.wait(5) and None     # a compile that holds its thread

    async def main():
        first = asyncio.ensure_future(c.compile(GrammarSpec.regex("first")))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(Overloaded, match="every structured-output compile thread is busy") as exc:
            await c.compile(GrammarSpec.regex("second"))
        assert exc.value.param == PARAM and time.monotonic() - start < 1.0
        # Asked now, with the only thread written off and not replaced, a new one waits its turn as well.
        with pytest.raises(Overloaded):
            await c.compile(GrammarSpec.regex("third"))
        with pytest.raises(InvalidArgument, match="did not compile within 0.2 s"):
            await first
        assert (await c.lookup(GrammarSpec.regex("warm")))[1] is True     # a cached one still answers

    try:
        asyncio.run(main())
    finally:
        release.set()
        c.close()


def test_close_waits_for_running_compiles_and_says_whether_any_is_left():
    # A process must not exit while a compile is inside xgrammar's C++ (the runtime aborts it).
    release = threading.Event()
    pool = CompilePool(1, 0.1, lambda job: InvalidArgument("late", param=PARAM), max_overdue=1)

    def stuck():
        release.wait(5)
        return "done"

    running = pool.submit(stuck)
    queued = pool.submit(stuck)
    time.sleep(0.05)
    pool.close()
    assert queued.cancelled() or queued.started is None
    assert pool.join(0.3) is False            # written off at 0.1 s, still running
    release.set()
    assert pool.join(2) is True
    with pytest.raises(InvalidArgument):
        running.result(timeout=0)


def test_close_right_after_start_waits_for_the_vocabulary_build(tokenizer):
    c = GrammarCompiler(tokenizer.backend, vocab_size=VOCAB, stop_token_ids=(EOS,))
    assert c.close(timeout=60) is True        # closed while the vocabulary was still building
    assert not c._builder.is_alive()
