"""GrammarState: it follows the request's accepted tokens exactly, and says when the grammar is complete."""
from __future__ import annotations

import json

import torch

from services.decoder.engine.step import SamplingParams, ScheduledChunk
from services.decoder.grammar.spec import GrammarSpec
from services.decoder.grammar.state import GrammarState, GrammarStates, clear_bits, only_stop
from tests.decoder.grammar.conftest import EOS, allowed

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                     "additionalProperties": False})


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_state_lives_under_its_request_id_until_the_request_finishes(compiler):
    grammar = compiler.compile_now(GrammarSpec.json_schema(SCHEMA))
    states = GrammarStates()

    def chunk(rid, g=grammar):
        return ScheduledChunk(rid, [5], 0, [0], True, SamplingParams(), grammar=g)
    state = states.of(chunk("r"))
    assert states.of(chunk("r")) is state and "r" in states     # every later chunk (preemption included)
    assert states.of(chunk("free", None)) is None and "free" not in states
    # Each choice of an n > 1 request is a request of its own, hence its own matcher.
    choice = states.of(chunk("r#1"))
    assert choice is not state
    # A runner several engines share may see an id again before hearing it finished: another prompt
    # tuple is another request.
    again = ScheduledChunk("r#1", [5], 0, [0], True, SamplingParams(), prompt_token_ids=(7,), grammar=grammar)
    assert states.of(again) is not choice and states.of(again) is states.of(again)
    states.forget(["r", "never-seen"])
    assert "r" not in states and len(states) == 1 and states.of(chunk("r")) is not state


def test_sync_feeds_each_accepted_token_once(compiler, tokenizer):
    grammar = compiler.compile_now(GrammarSpec.json_schema(SCHEMA))
    tokens = ids(tokenizer, '{"a": 12')
    fed = GrammarState(grammar)
    for t in tokens:
        assert not fed.advance(t)
    # Synced to what it already consumed (a recompute after preemption): nothing is fed again.
    fed.sync(tokens)
    assert fed.num_accepted == len(tokens)
    caught_up = GrammarState(grammar)
    caught_up.sync(tokens)                         # outputs it never saw are fed once
    caught_up.sync(tokens)
    a, b = torch.empty_like(grammar.bits.no_stop), torch.empty_like(grammar.bits.no_stop)
    fed.fill(a)
    caught_up.fill(b)
    assert torch.equal(a, b) and caught_up.num_accepted == len(tokens)
    # Ahead of the request (outputs it was told of were dropped): rolled back to them.
    caught_up.sync(tokens[:2])
    assert caught_up.num_accepted == 2
    fresh = GrammarState(grammar)
    fresh.sync(tokens[:2])
    caught_up.fill(a)
    fresh.fill(b)
    assert torch.equal(a, b)


def test_a_complete_grammar_ends_without_spending_a_step_on_eos(compiler, tokenizer):
    state = GrammarState(compiler.compile_now(GrammarSpec.json_schema(SCHEMA)))
    *body, last = ids(tokenizer, '{"a": 7}')
    mask = torch.empty_like(state.grammar.bits.no_stop)
    for t in body:
        assert not state.advance(t)
        state.fill(mask)
        assert EOS not in allowed(mask)            # EOS only where the grammar may end
    assert state.advance(last)                     # "}" completes it and nothing may follow


def test_a_grammar_that_may_go_on_allows_eos_and_ends_on_it(compiler, tokenizer):
    state = GrammarState(compiler.compile_now(GrammarSpec.regex("a+")))
    assert not state.advance(ids(tokenizer, "a")[0])
    assert state.next_mask is not None           # computed to decide; reused for the next token
    mask = torch.empty_like(state.grammar.bits.no_stop)
    state.fill(mask)
    assert EOS in allowed(mask) and not only_stop(mask, state.grammar.bits.no_stop)
    assert not only_stop(clear_bits(mask, [EOS]), state.grammar.bits.no_stop)
    assert only_stop(clear_bits(mask, [t for t in allowed(mask).tolist() if t != EOS]), state.grammar.bits.no_stop)
    assert state.advance(EOS) and state.matcher.is_terminated()


def test_a_refused_token_ends_the_choice_instead_of_raising(compiler, tokenizer):
    state = GrammarState(compiler.compile_now(GrammarSpec.choice(["yes", "no"])))
    assert state.advance(ids(tokenizer, "maybe")[0]) is True
