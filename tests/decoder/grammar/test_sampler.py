"""The sampler with constrained rows: masks only those rows, keeps raw logprobs, lets a complete grammar stop
even under min_tokens, and reports completion."""
from __future__ import annotations

import json
import re

import torch

from services.decoder.engine.step import SamplingParams, ScheduledChunk
from services.decoder.grammar.spec import GrammarSpec
from services.decoder.runner.sampler import Sampler
from tests.decoder.grammar.conftest import EOS, VOCAB


def chunk(rid, sampling, grammar=None, outputs=(), blocked=()):
    return ScheduledChunk(rid, [5], 0, [0], True, sampling, list(outputs), 1, grammar=grammar,
                          blocked_token_ids=tuple(blocked))


def test_only_constrained_rows_are_masked(compiler, tokenizer):
    grammar = compiler.compile_now(GrammarSpec.choice(["yes", "no"]))
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=9, logprobs=2)
    alone = Sampler(0)([logits[1:2].clone()][0], [chunk("free", seeded)])[0]
    feats = [grammar, None, grammar, None]
    params = [SamplingParams(temperature=0, logprobs=0), seeded, SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0)]
    raw = logits.clone()
    sampler = Sampler(0)
    out = sampler(logits, [chunk(f"r{i}", p, f) for i, (p, f) in enumerate(zip(params, feats, strict=True))])
    for row in (0, 2):      # a first piece of one of the choices ("y", "yes", "n", ...)
        piece = tokenizer.decode([out[row].token_id])
        assert piece and ("yes".startswith(piece) or "no".startswith(piece)), piece
    # The unconstrained rows: untouched logits, the same seeded draw as alone, the same argmax.
    assert torch.equal(logits[1], raw[1]) and torch.equal(logits[3], raw[3])
    assert (out[1].token_id, out[1].logprob) == (alone.token_id, alone.logprob)
    assert out[3].token_id == int(raw[3].argmax())
    # Logprobs are the raw model's, not the masked row's.
    assert abs(out[0].logprob - float(torch.log_softmax(raw[0], -1)[out[0].token_id])) < 1e-5
    states = sampler.grammars.states
    assert states.of(chunk("r0", params[0], grammar)).num_accepted == 1 and "r1" not in states and len(states) == 2


def test_a_complete_grammar_stops_even_before_min_tokens(compiler, tokenizer):
    schema = json.dumps({"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"]})
    grammar = compiler.compile_now(GrammarSpec.json_schema(schema))
    sampler = Sampler(0)
    feats = grammar
    outputs = []
    params = SamplingParams(temperature=0, min_tokens=50)
    for _ in range(20):
        result = sampler(torch.randn(1, VOCAB), [chunk("r", params, feats, outputs, blocked=(EOS,))])[0]
        outputs.append(result.token_id)
        if result.complete:
            break
    assert result.complete and json.loads(tokenizer.decode(outputs)) == {"a": 1}


def test_min_tokens_still_blocks_eos_where_the_grammar_may_go_on(compiler, tokenizer):
    grammar = compiler.compile_now(GrammarSpec.regex("a+"))
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 50.0                           # the model wants to stop
    feats = grammar
    sampler = Sampler(0)
    first = sampler(logits.clone(), [chunk("r", SamplingParams(temperature=0), feats)])[0]
    assert first.token_id == a and not first.complete
    held = sampler(logits.clone(), [chunk("r", SamplingParams(temperature=0, min_tokens=3), feats, [a],
                                          blocked=(EOS,))])[0]
    assert held.token_id != EOS and not held.complete
    free = sampler(logits.clone(), [chunk("r", SamplingParams(temperature=0), feats, [a, held.token_id])])[0]
    assert free.token_id == EOS and free.complete


def test_a_failing_matcher_ends_its_choice_and_not_the_batch(compiler, tokenizer):
    grammar = compiler.compile_now(GrammarSpec.regex("[a-z]+"))
    broken = fine = grammar
    sampler = Sampler(0)
    first = sampler(torch.randn(2, VOCAB), [chunk("a", SamplingParams(temperature=0), broken),
                                            chunk("b", SamplingParams(temperature=0), fine)])

    class Exploding:
        def __getattr__(self, name):
            raise RuntimeError("library bug")
    state = sampler.grammars.states.of(chunk("a", SamplingParams(temperature=0), broken))
    state.matcher = Exploding()
    # "a" has one more accepted token than its matcher saw: following it raises, so its mask allows only the stop.
    out = sampler(torch.randn(3, VOCAB), [
        chunk("a", SamplingParams(temperature=0), broken, [first[0].token_id, first[0].token_id]),
        chunk("b", SamplingParams(temperature=0), fine, [first[1].token_id]),
        chunk("c", SamplingParams(temperature=0))])
    assert state.broken and out[0].token_id == EOS and out[0].complete     # ended, nothing raised
    piece = tokenizer.decode([out[1].token_id])
    assert out[1].token_id == EOS or re.fullmatch("[a-z]+", piece)
