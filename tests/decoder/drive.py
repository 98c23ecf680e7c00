"""Drive an EngineCore over a list of prompts to the end: the loop the engine-level parity tests share."""
from __future__ import annotations

from collections.abc import Sequence

from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.step import SampledToken, SamplingParams


def drive(core: EngineCore, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
          stagger: int = 1, max_steps: int = 2000) -> dict[tuple[int, int], list[SampledToken]]:
    """Add prompt i as request str(i), one every `stagger` steps (0: all before the first step), step until
    every request is done, check that the core is idle; -> {(prompt index, choice index): emitted tokens}.
    Every choice must run to max_tokens (the prompts' sampling ignores EOS)."""
    tokens: dict[tuple[int, int], list[SampledToken]] = {}
    pending = list(enumerate(prompts))
    if not stagger:
        for i, p in pending:
            core.add_request(str(i), p, sampling)
        pending = []
    steps = 0
    while pending or core.has_unfinished():
        if pending and steps % stagger == 0:
            i, p = pending.pop(0)
            core.add_request(str(i), p, sampling)
        for out in core.step():
            assert out.finish_reason in (None, "length"), out
            tokens.setdefault((int(out.request_id), out.index), []).extend(out.new_tokens)
        steps += 1
        assert steps < max_steps
    core.check_idle()
    return tokens


def token_ids(tokens: dict[tuple[int, int], list[SampledToken]], count: int) -> list[list[int]]:
    """{(prompt, choice): tokens} of n = 1 requests -> each prompt's token ids, in prompt order."""
    return [[t.token_id for t in tokens[(i, 0)]] for i in range(count)]
