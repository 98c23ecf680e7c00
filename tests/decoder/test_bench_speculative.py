"""bench/speculative.py's ceiling: the least time a choice of draft lengths that knew the outputs could take, on
outputs small enough to count by hand."""
from __future__ import annotations

from bench.speculative import ceiling
from services.decoder.engine.config import SpeculativeConfig

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1)


def test_a_quoted_prompt_takes_two_steps_where_verifying_is_free():
    # out[0] comes from the prefill. From out[:1] = [10] the drafter proposes 11..14 (all accepted: 5 tokens in one
    # step); from out[:6] it may draft one (the 8 tokens' last), accepted: 7 decode tokens in 2 steps.
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]
    assert ceiling([prompt], [list(prompt)], SPEC, (1.0,) * 5) == (7.0, 2.0)


def test_drafts_that_cost_more_than_they_gain_are_not_taken():
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]
    out = [10, 11, 99, 98, 97, 96, 95, 94]   # the quote stops after one token: a draft of k wins one token at most
    assert ceiling([prompt], [out], SPEC, (1.0, 3.0, 3.0, 3.0, 3.0)) == (7.0, 7.0)
    # Cheap verification: the first step drafts 11 (accepted) with the rest rejected for free, then no draft hits.
    plain, least = ceiling([prompt], [out], SPEC, (1.0,) * 5)
    assert (plain, least) == (7.0, 6.0)


def test_outputs_that_repeat_nothing_gain_nothing():
    assert ceiling([[1, 2, 3]], [[7, 8, 9, 10]], SPEC, (1.0, 1.1, 1.2, 1.3, 1.4)) == (3.0, 3.0)
