"""GrammarCompiler: clean errors naming the field, one compile per spec, a bounded cache, and the
token bits every mask is combined with (special tokens, control bytes in JSON)."""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from services.common.errors import InvalidArgument
from services.decoder.grammar.cache import FutureCache
from services.decoder.grammar.compiled import bit_row
from services.decoder.grammar.spec import PARAM, GrammarSpec
from services.decoder.grammar.state import GrammarState
from tests.decoder.grammar.conftest import EOS, VOCAB, allowed

BAD = [
    (GrammarSpec("json_schema", '{"type": "foo"}'), "the JSON schema does not compile: Unsupported type \"foo\""),
    (GrammarSpec("json_schema", '{"$ref": "#/$defs/missing"}'), "the JSON schema does not compile"),
    (GrammarSpec("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}'), "minLength 5"),
    (GrammarSpec.regex("(["), "the regex does not compile: Regex parsing error at position 3"),
    (GrammarSpec.regex("(a)\\1"), "Backreference is not supported"),
    (GrammarSpec.regex("(?=a)a"), "Lookahead is not supported"),
    (GrammarSpec.grammar('root ::= "a" |'), "the grammar does not compile"),
    (GrammarSpec.grammar("start: \"a\""), "EBNF"),                    # Lark is not xgrammar's dialect
    (GrammarSpec.grammar('start ::= "a"'), 'root rule with name "root"'),
]


@pytest.mark.parametrize("spec, says", BAD, ids=[f"{s.kind}-{i}" for i, (s, _) in enumerate(BAD)])
def test_a_spec_that_does_not_compile_is_invalid_argument(compiler, spec, says):
    with pytest.raises(InvalidArgument) as exc:
        compiler.compile_now(spec)
    assert exc.value.param == PARAM and says in exc.value.message, exc.value.message
    assert "/project/cpp" not in exc.value.message and "[" not in exc.value.message[:2]


def test_the_cache_compiles_each_spec_once(compiler):
    spec = GrammarSpec.regex("[0-9]{4}-cache")
    first, hit = compiler.submit(spec)
    again, hit_again = compiler.submit(GrammarSpec.regex("[0-9]{4}-cache"))
    assert (hit, hit_again) == (False, True) and again is first
    assert compiler.compile_now(spec) is first.result()
    # A failed compile is not kept: asked again, it is compiled (and refused) again.
    bad = GrammarSpec.regex("[unclosed")
    with pytest.raises(InvalidArgument):
        compiler.compile_now(bad)
    assert compiler.submit(bad)[1] is False


def test_concurrent_requests_share_one_compile_and_cancel_none(compiler):
    spec = GrammarSpec.json_schema(json.dumps({"type": "object", "properties": {"shared": {"type": "integer"}}}))

    async def ask(cancel: bool):
        task = asyncio.ensure_future(compiler.compile(spec))
        if cancel:
            await asyncio.sleep(0)
            task.cancel()
            return None
        return await task

    async def main():
        return await asyncio.gather(*(ask(i == 0) for i in range(8)))

    results = asyncio.run(main())
    assert results[0] is None and len({id(r) for r in results[1:]}) == 1   # the cancelled caller hurt no one


def test_future_cache_is_bounded_lru():
    cache = FutureCache(2)
    done = {}

    def start(value):
        def make():
            f = Future()
            f.set_result(value)
            done[value] = f
            return f
        return make

    cache.get_or_start("a", start("a"))
    cache.get_or_start("b", start("b"))
    assert cache.get_or_start("a", start("a2"))[0] is done["a"]       # a is now the most recent
    cache.get_or_start("c", start("c"))                                # evicts b
    assert len(cache) == 2 and cache.get_or_start("b", start("b2"))[1] is False
    with pytest.raises(ValueError):
        FutureCache(0)


def test_compiles_run_off_the_calling_thread(compiler):
    # The pool's threads do the work; many distinct specs at once all complete.
    with ThreadPoolExecutor(4) as pool:
        grammars = list(pool.map(lambda i: compiler.compile_now(GrammarSpec.regex(f"x{{{i}}}")), range(12)))
    assert len({id(g) for g in grammars}) == 12


def test_special_tokens_are_never_allowed_but_the_stop(compiler, tokenizer):
    # A JSON string may hold any text, "<|im_start|>" included, but the special token itself would vanish
    # from the answer (the detokenizer skips it), so only its plain spelling is allowed.
    grammar = compiler.compile_now(GrammarSpec.json_schema('{"type": "string"}'))
    state = GrammarState(grammar)
    assert not state.advance(tokenizer.encode('"', add_special_tokens=False)[0])
    mask = torch.empty_like(grammar.bits.no_stop)
    state.fill(mask)
    ids = set(allowed(mask).tolist())
    specials = tokenizer.all_special_ids - {EOS}
    assert specials and not specials & ids and len(ids) > 40000
    assert not state.matcher.is_completed() and EOS not in ids


def test_control_bytes_are_banned_in_json_even_where_xgrammar_allows_them(compiler, tokenizer):
    # xgrammar 0.2.8 accepts a raw control byte inside a maxLength-bounded string (invalid JSON).
    grammar = compiler.compile_now(GrammarSpec.json_schema('{"type": "string", "maxLength": 6}'))
    form_feed = tokenizer.encode("\x0c", add_special_tokens=False)
    assert len(form_feed) == 1
    state = GrammarState(grammar)
    for token in tokenizer.encode('"ab', add_special_tokens=False):
        state.advance(token)
    raw = torch.empty_like(grammar.bits.no_stop)
    state.matcher.fill_next_token_bitmask(raw.view(1, -1), 0)
    mask = torch.empty_like(raw)
    state.fill(mask)
    assert form_feed[0] in allowed(raw) and form_feed[0] not in allowed(mask)
    # Regexes keep them: a control character is fine text there.
    regex = GrammarState(compiler.compile_now(GrammarSpec.regex("a[\\x00-\\x1f]")))
    regex.advance(tokenizer.encode("a", add_special_tokens=False)[0])
    regex.fill(mask)
    assert form_feed[0] in allowed(mask)


def test_bit_rows_use_xgrammars_layout():
    flags = torch.zeros(70, dtype=torch.bool)
    flags[[0, 31, 32, 69]] = True
    row = bit_row(flags.numpy())
    assert row.dtype == torch.int32 and row.shape == (3,)
    assert allowed_small(row, 70) == [0, 31, 32, 69] and VOCAB % 32 == 0


def allowed_small(row, n):
    bits = (row.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.view(-1)[:n]).view(-1).tolist()
