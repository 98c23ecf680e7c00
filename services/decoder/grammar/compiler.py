"""GrammarSpec -> Grammar on a small thread pool, off the engine thread and the event loop, cached.

    compiler = GrammarCompiler(tokenizer, vocab_size=runner.vocab_size, stop_token_ids=eos, threads=2)
    grammar = await compiler.compile(spec)     # InvalidArgument (param structured_output) if it does not compile

The server awaits the compile before it adds the request to the engine, so a slow schema holds up
only its own request; the engine steps on. Compiled grammars are kept by spec key (kind, canonical
text) in a bounded LRU; concurrent requests for one new spec share one compile. The tokenizer's
xgrammar vocabulary (~0.2 s for SmolLM2) is built on the pool as soon as the compiler exists, so
serving starts without waiting for it and the first structured request rarely does.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version

import xgrammar as xgr
from tokenizers import Tokenizer as HFTokenizer

from services.common import compute
from services.common.errors import InvalidArgument, TesseraError, Unsupported
from services.decoder.grammar.cache import FutureCache
from services.decoder.grammar.compiled import Grammar, TokenBits
from services.decoder.grammar.spec import PARAM, GrammarSpec

log = logging.getLogger("tessera.decoder.grammar")

# xgrammar's messages start with a timestamp and its C++ source line; the caller needs neither.
_NOISE = re.compile(r"\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")
_WHAT = {"json_schema": "the JSON schema does not compile", "json_object": "the JSON object grammar failed",
         "regex": "the regex does not compile", "choice": "the choices do not compile",
         "grammar": "the grammar does not compile (xgrammar's EBNF, with a `root ::= ...` rule)"}


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


class GrammarCompiler:
    """tokenizer: the decoder's `tokenizers.Tokenizer` (copied, not changed); special_token_ids: the
    tokenizer's special ids, never allowed but as a stop; vocab_size: the logits width."""

    def __init__(self, tokenizer: HFTokenizer, *, vocab_size: int, stop_token_ids: tuple[int, ...],
                 special_token_ids: frozenset[int] = frozenset(), threads: int = 2, cache_size: int = 256):
        if not stop_token_ids:
            raise ValueError("structured outputs need at least one stop token id")
        # Serial: its token masks are torch tensors, and a lasting OpenMP team here would throttle the
        # engine thread's (services/common/compute.py).
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar", initializer=compute.serial_here)
        self._threads = threads
        self._cache = FutureCache(cache_size)
        self._vocabulary = self._pool.submit(self._build, tokenizer, vocab_size, tuple(stop_token_ids),
                                             frozenset(special_token_ids))

    def _build(self, tokenizer: HFTokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
               special_token_ids: frozenset[int]) -> _Vocabulary:
        start = time.perf_counter()
        info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        # Our FutureCache is the one cache (bounded by entries); xgrammar's own would be a second.
        vocab = _Vocabulary(xgr.GrammarCompiler(info, max_threads=self._threads, cache_enabled=False),
                            TokenBits.build(info, stop_token_ids, special_token_ids))
        log.info("structured outputs ready: xgrammar %s, %s vocabulary of %d, stop tokens %s (%.2f s)",
                 version("xgrammar"), info.vocab_type.name, info.vocab_size, list(stop_token_ids),
                 time.perf_counter() - start)
        return vocab

    @property
    def cache(self) -> FutureCache:
        return self._cache

    def submit(self, spec: GrammarSpec) -> tuple[Future, bool]:
        """(future of the Grammar, cache hit)."""
        return self._cache.get_or_start(spec.key, lambda: self._pool.submit(self._compile, spec))

    async def compile(self, spec: GrammarSpec) -> Grammar:
        future, _ = self.submit(spec)
        # Shielded: a caller that goes away must not cancel a compile other requests share.
        return await asyncio.shield(asyncio.wrap_future(future))

    def compile_now(self, spec: GrammarSpec) -> Grammar:
        """Blocking form (tests, benchmarks)."""
        return self.submit(spec)[0].result()

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

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
