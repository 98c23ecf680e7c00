"""GrammarSpec -> Grammar on a few compile threads, off the engine thread and the event loop, cached.

    compiler = GrammarCompiler(tokenizer, vocab_size=runner.vocab_size, stop_token_ids=eos, threads=2,
                               deadline_s=10.0, cache_bytes=256 << 20)
    grammar, hit = await compiler.lookup(spec)   # InvalidArgument (param structured_output) if it does not
                                                 # compile, or not within the deadline; Overloaded if no
                                                 # compile thread took it within the deadline

The server awaits the compile before it adds the request to the engine, so a slow schema holds up
only its own request; the engine steps on. Compiled grammars are kept by spec key (kind, canonical
text) in an LRU bounded by entries and by bytes (xgrammar's own measure of a compiled grammar, plus
the spec's text); concurrent requests for one new spec share one compile, and a cached one is answered
without touching the compile threads. The tokenizer's xgrammar vocabulary (~0.2 s for SmolLM2) is built
on its own thread as soon as the compiler exists, so serving starts without waiting for it; then
json_object, the one grammar with no input, is compiled and kept for good, so it never waits behind
another request's compile.

A compile has deadline_s from the moment a thread takes it (services/decoder/grammar/pool.py says why a
compile past it is written off rather than killed): past it the request gets InvalidArgument naming its
field, and the spec is remembered (by digest, the last REFUSALS of them, for REFUSAL_S) so a repeat is
refused at once without taking a thread; forgotten after that, so a spec that was slow only because the
machine was (a CPU shared with a burst of requests) is compiled again. Small inputs can compile slowly
(`[^0-9]{1,999}[0-9]{1,999}`, 25 characters, takes about 2 s on a Zen 4), so the size limits
(services/decoder/server/validation.py) are not enough on their own.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from importlib.metadata import version

import xgrammar as xgr
from tokenizers import Tokenizer as HFTokenizer

from services.common import compute
from services.common.errors import InvalidArgument, Overloaded, TesseraError, Unsupported
from services.decoder.grammar.cache import FutureCache
from services.decoder.grammar.compiled import Grammar, TokenBits
from services.decoder.grammar.pool import CompilePool, Job, JobFuture
from services.decoder.grammar.spec import PARAM, GrammarSpec

log = logging.getLogger("tessera.decoder.grammar")

# xgrammar's messages start with a timestamp and its C++ source line; the caller needs neither.
_NOISE = re.compile(r"\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")
_WHAT = {"json_schema": "the JSON schema does not compile", "json_object": "the JSON object grammar failed",
         "regex": "the regex does not compile", "choice": "the choices do not compile",
         "grammar": "the grammar does not compile (xgrammar's EBNF, with a `root ::= ...` rule)"}
_NAME = {"json_schema": "the JSON schema", "json_object": "the JSON object grammar", "regex": "the regex",
         "choice": "the choices", "grammar": "the grammar"}
REFUSALS = 4096     # specs remembered as past the deadline (32-byte digests) ...
REFUSAL_S = 600.0   # ... for this long


@dataclass(frozen=True)
class _Vocabulary:
    compiler: xgr.GrammarCompiler
    bits: TokenBits


def tokenizer_info(tokenizer: HFTokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """xgrammar's view of the tokenizer, sized to the model's logits width (vocab_size)."""
    from transformers import PreTrainedTokenizerFast  # xgrammar imports transformers anyway
    # A copy: transformers may set padding/truncation on the object it wraps, and ours encodes prompts.
    wrapped = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tokenizer.to_str()))
    return xgr.TokenizerInfo.from_huggingface(wrapped, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


def _clean(exc: Exception) -> str:
    text = _NOISE.sub("", str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _choice_grammar(choices: list[str]) -> str:
    # A JSON string literal is an xgrammar EBNF literal (the same escapes, UTF-8 kept as is).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _digest(spec: GrammarSpec) -> bytes:
    return hashlib.sha256(f"{spec.kind}\0{spec.text}".encode()).digest()


def _weigh(grammar: Grammar) -> int:
    """Bytes a cached Grammar holds: xgrammar's compiled grammar (its token-mask cache) and the spec text."""
    return grammar.compiled.memory_size_bytes + len(grammar.spec.text.encode())


class GrammarCompiler:
    """tokenizer: the decoder's `tokenizers.Tokenizer` (copied, not changed); special_token_ids: the
    tokenizer's special ids, never allowed but as a stop; vocab_size: the logits width; threads: compiles
    at once; deadline_s: the longest one compile may run; max_overdue: compiles past it still running at
    most before their threads are no longer replaced (default: threads; services/decoder/grammar/pool.py);
    cache_size / cache_bytes: the cache's bounds (entries, bytes of compiled grammars; None: entries only)."""

    def __init__(self, tokenizer: HFTokenizer, *, vocab_size: int, stop_token_ids: tuple[int, ...],
                 special_token_ids: frozenset[int] = frozenset(), threads: int = 2, cache_size: int = 256,
                 cache_bytes: int | None = None, deadline_s: float = 10.0, max_overdue: int | None = None):
        if not stop_token_ids:
            raise ValueError("structured outputs need at least one stop token id")
        # Serial: its token masks are torch tensors, and a lasting OpenMP team here would throttle the
        # engine thread's (services/common/compute.py).
        self._pool = CompilePool(threads, deadline_s, self._overdue, max_overdue=max_overdue,
                                 initializer=compute.serial_here)
        self._threads = threads
        self.deadline_s = deadline_s
        self._cache = FutureCache(cache_size, cache_bytes, weigh=_weigh)
        self._refused: OrderedDict[bytes, tuple[str, float]] = OrderedDict()    # digest -> (message, until)
        self._refused_lock = threading.Lock()
        self._vocabulary: Future = Future()
        self._builder = threading.Thread(target=self._build, name="grammar-vocabulary", daemon=True,
                                         args=(tokenizer, vocab_size, tuple(stop_token_ids),
                                               frozenset(special_token_ids)))
        self._builder.start()

    def _build(self, tokenizer: HFTokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
               special_token_ids: frozenset[int]) -> None:
        compute.serial_here()
        start = time.perf_counter()
        try:
            info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
            # Our FutureCache is the one cache (bounded by entries and bytes); xgrammar's own would be a second.
            vocab = _Vocabulary(xgr.GrammarCompiler(info, max_threads=self._threads, cache_enabled=False),
                                TokenBits.build(info, stop_token_ids, special_token_ids))
        except Exception as exc:  # noqa: BLE001 - reported per request (_compile), the server stays up
            self._vocabulary.set_exception(exc)
            return
        log.info("structured outputs ready: xgrammar %s, %s vocabulary of %d, stop tokens %s (%.2f s)",
                 version("xgrammar"), info.vocab_type.name, info.vocab_size, list(stop_token_ids),
                 time.perf_counter() - start)
        # Pinned: the one input-free grammar, asked for by any client, never waits behind a crafted compile. Queued
        # before the vocabulary is published, so no request waiting on it can take the compile threads first (its
        # compile waits on the vocabulary for the moment until the line after).
        json_object = GrammarSpec.json_object()
        try:
            self._cache.get_or_start(json_object.key, lambda: self._pool.submit(self._compile, json_object),
                                     pin=True)
        except RuntimeError:
            pass    # closed before the vocabulary was ready: nothing is served any more
        self._vocabulary.set_result(vocab)

    @property
    def cache(self) -> FutureCache:
        return self._cache

    @property
    def pool(self) -> CompilePool:
        return self._pool

    def submit(self, spec: GrammarSpec) -> tuple[Future, bool]:
        """(future of the Grammar, cache hit). A spec once past the deadline fails at once."""
        digest = _digest(spec)
        with self._refused_lock:
            message, until = self._refused.get(digest, (None, 0.0))
            if message is not None and time.monotonic() >= until:
                del self._refused[digest]
                message = None
        if message is not None:
            refused: Future = Future()
            refused.set_exception(InvalidArgument(message, param=PARAM))
            return refused, False
        return self._cache.get_or_start(spec.key, lambda: self._pool.submit(self._compile, spec))

    async def lookup(self, spec: GrammarSpec) -> tuple[Grammar, bool]:
        """(Grammar, cache hit), waiting at most deadline_s for a thread to take the compile and deadline_s
        for it to run (the pool fails it then)."""
        if not self._vocabulary.done():
            # Waited for here, not on a compile thread, so a slow vocabulary does not count as the spec's.
            await asyncio.wait({asyncio.wrap_future(self._vocabulary)})
        future, hit = self.submit(spec)
        wrapped = asyncio.wrap_future(future)
        # Read once done: a caller that left (or was answered Overloaded) leaves no "never retrieved" log.
        wrapped.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            # Shielded: a caller that goes away (or times out) must not cancel a compile other requests share.
            return await asyncio.wait_for(asyncio.shield(wrapped), self.deadline_s), hit
        except TimeoutError:
            if not isinstance(future, JobFuture) or future.started is None:
                raise Overloaded(f"every structured-output compile thread is busy: {_NAME[spec.kind]} waited "
                                 f"{self.deadline_s:g} s without starting; retry later", param=PARAM) from None
        return await asyncio.shield(wrapped), hit

    async def compile(self, spec: GrammarSpec) -> Grammar:
        return (await self.lookup(spec))[0]

    def compile_now(self, spec: GrammarSpec) -> Grammar:
        """Blocking form (tests, benchmarks): waits for the vocabulary, then for the compile (the pool's
        deadline bounds it once started)."""
        try:
            self._vocabulary.result()
        except Exception:  # noqa: BLE001, S110 - _compile reports it as the request's error
            pass
        return self.submit(spec)[0].result()

    def _overdue(self, job: Job) -> InvalidArgument:
        spec: GrammarSpec = job.args[0]
        message = (f"{_NAME[spec.kind]} did not compile within {self.deadline_s:g} s (the decoder's "
                   f"--grammar-compile-timeout-s); simplify it (fewer or smaller repetition bounds, a smaller schema)")
        if spec.kind != "json_object":      # no input to craft: slow only because the machine was
            with self._refused_lock:
                self._refused[_digest(spec)] = message, time.monotonic() + REFUSAL_S
                while len(self._refused) > REFUSALS:
                    self._refused.popitem(last=False)
        log.warning("a %s compile ran past %g s and was written off (%d written-off compiles still running)",
                    spec.kind, self.deadline_s, self._pool.overdue)
        return InvalidArgument(message, param=PARAM)

    def _compile(self, spec: GrammarSpec) -> Grammar:
        try:
            vocab = self._vocabulary.result()
        except Exception as exc:  # noqa: BLE001 - reported per request, the server stays up
            raise Unsupported(f"structured outputs are unavailable for this model's tokenizer: {_clean(exc)}",
                              param=PARAM) from None
        c = vocab.compiler
        try:
            if spec.kind == "json_schema":
                # Compact JSON: free whitespace lets a weak model spend its whole budget on spaces.
                compiled = c.compile_json_schema(spec.text, any_whitespace=False, strict_mode=True)
            elif spec.kind == "json_object":
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif spec.kind == "regex":
                compiled = c.compile_regex(spec.text)
            elif spec.kind == "choice":
                compiled = c.compile_grammar(_choice_grammar(json.loads(spec.text)))
            elif spec.kind == "grammar":
                compiled = c.compile_grammar(spec.text)
            else:
                raise InvalidArgument(f"unknown structured output kind {spec.kind!r}", param=PARAM)
        except TesseraError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError; both are the input's
            raise InvalidArgument(f"{_WHAT[spec.kind]}: {_clean(exc)}", param=PARAM) from None
        return Grammar(spec, compiled, vocab.bits)

    def close(self, timeout: float | None = None) -> bool:
        """Cancel queued compiles, then wait for the vocabulary build and the running compiles (up to
        timeout seconds, default the compile deadline): whether no xgrammar call is left running. A process
        must not exit under one (services/decoder/grammar/pool.py)."""
        self._pool.close()
        end = time.monotonic() + (self.deadline_s if timeout is None else timeout)
        self._builder.join(max(0.0, end - time.monotonic()))
        return not self._builder.is_alive() and self._pool.join(max(0.0, end - time.monotonic()))
