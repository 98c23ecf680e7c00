"""One request's grammar matcher, kept by the runner under the request's id for as long as it lives.

The server hands the shared compiled Grammar to the engine with the request (Request.grammar, then
ScheduledChunk.grammar on every chunk); the sampler's GrammarStates creates the request's GrammarState
the first time the request is sampled and drops it when the engine lists the request as finished
(StepInput.finished_request_ids). A preempted request keeps its id, hence its matcher. Each choice of
an n > 1 request is a request of its own ("<id>#<i>"), hence its own matcher.

The matcher follows the tokens the engine accepted, never the tokens it computed: num_accepted is
how many of the request's outputs it has consumed. Only sampled chunks reach it; a prefill chunk, a
prefix-cache hit, or the recompute of prompt + outputs after preemption (which the engine feeds as
known tokens, not samples) leave it alone, and `sync` checks the count against the outputs before
each mask, so nothing is fed twice.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np
import torch
import xgrammar as xgr

from services.decoder.engine.step import ScheduledChunk
from services.decoder.grammar.compiled import Grammar

log = logging.getLogger("tessera.decoder.grammar")


def only_stop(mask: torch.Tensor, no_stop: torch.Tensor) -> bool:
    """mask int32 [W]: True when it allows nothing but stop tokens."""
    return not bool((mask & no_stop).any())


class GrammarState:
    """The matcher of one request. next_mask: the mask for the next token, when `advance` already had
    to compute it (int32 [W], ban applied), else None."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.num_accepted = 0
        self.next_mask: torch.Tensor | None = None
        self.broken = False         # the library failed on it: its masks allow nothing, the choice ends
        try:
            self.matcher = xgr.GrammarMatcher(grammar.compiled,
                                              override_stop_tokens=list(grammar.bits.stop_token_ids))
        except Exception:  # noqa: BLE001 - a grammar must not take the engine down
            log.exception("could not start a grammar matcher; ending the choice")
            self.matcher, self.broken = None, True

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Make the matcher have consumed exactly output_token_ids (normally a no-op: `advance` fed each)."""
        if self.broken:
            return
        try:
            self._sync(output_token_ids)
        except Exception:  # noqa: BLE001 - a grammar must not take the engine down
            log.exception("grammar matcher failed to follow its request; ending the choice")
            self.broken = True

    def _sync(self, output_token_ids: Sequence[int]) -> None:
        n = len(output_token_ids)
        if self.num_accepted > n:
            log.error("grammar matcher ahead of its request (%d > %d tokens); rolling back", self.num_accepted, n)
            self.matcher.rollback(self.num_accepted - n)
            self.num_accepted, self.next_mask = n, None
        for token in output_token_ids[self.num_accepted:]:
            self.next_mask = None
            if not self.matcher.accept_token(int(token)):
                log.error("grammar matcher refused accepted token %d", token)
                break
            self.num_accepted += 1

    def fill(self, out: torch.Tensor) -> None:
        """Write the next token's mask into out (int32 [W]), the grammar's ban applied."""
        if self.broken:
            out.zero_()
            return
        if self.next_mask is not None:
            out.copy_(self.next_mask)
            return
        self.matcher.fill_next_token_bitmask(out.view(1, -1), 0)
        self.finish_mask(out)

    def finish_mask(self, out: torch.Tensor) -> None:
        """Apply the grammar's ban to a freshly filled mask (int32 [W], in place)."""
        out &= self.grammar.ban

    def advance(self, token_id: int) -> bool:
        """Accept the sampled token. True when the grammar is complete: only a stop token could follow
        (or the stop token itself was taken), so the request must end here. Never raises: a library
        failure ends the choice and leaves the engine running."""
        self.next_mask = None
        if self.broken:
            return True
        try:
            return self._advance(token_id)
        except Exception:  # noqa: BLE001 - a grammar must not take the engine down
            log.exception("grammar matcher failed after %d tokens; ending the choice", self.num_accepted)
            return True

    def _advance(self, token_id: int) -> bool:
        if not self.matcher.accept_token(int(token_id)):
            # Cannot happen for a token drawn from the masked logits; ending the choice keeps the
            # engine (and every other request) running.
            log.error("grammar refused sampled token %d after %d tokens; ending the choice", token_id,
                      self.num_accepted)
            return True
        self.num_accepted += 1
        if self.matcher.is_terminated():
            return True
        if self.matcher.is_completed():
            # The root rule matched: end now if nothing may follow, rather than spend a step on EOS.
            mask = torch.empty_like(self.grammar.bits.no_stop)
            self.matcher.fill_next_token_bitmask(mask.view(1, -1), 0)
            self.finish_mask(mask)
            if only_stop(mask, self.grammar.bits.no_stop):
                return True
            self.next_mask = mask
        return False


class GrammarStates:
    """request_id -> GrammarState: the matchers of the requests in flight, owned by the runner's sampler.

    Each entry also holds its request's prompt (the chunk's prompt_token_ids, the request's own tuple):
    a runner that several engines share (tests, benches) can see an id again before the engine that
    ended the first request steps again to say so, and a different request is a different tuple.
    """

    def __init__(self) -> None:
        self._states: dict[str, tuple[Sequence[int], GrammarState]] = {}

    def of(self, chunk: ScheduledChunk) -> GrammarState | None:
        """The chunk's request's state, created on first use; None for an unconstrained request."""
        if chunk.grammar is None:
            return None
        entry = self._states.get(chunk.request_id)
        if entry is None or entry[0] is not chunk.prompt_token_ids:
            entry = self._states[chunk.request_id] = (chunk.prompt_token_ids, GrammarState(chunk.grammar))
        return entry[1]

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the states of finished requests (StepInput.finished_request_ids)."""
        for rid in request_ids:
            self._states.pop(rid, None)

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states


def clear_bits(mask: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """A copy of mask (int32 [W]) with token_ids disallowed."""
    words = mask.numpy().view(np.uint32).copy()
    for t in token_ids:
        if 0 <= t < words.size * 32:
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
    return torch.from_numpy(words.view(np.int32))
