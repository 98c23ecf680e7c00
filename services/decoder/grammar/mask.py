"""The allowed-token masks of one step's constrained rows: filled in one batch, applied in place.

    masks = GrammarMasks()
    masks.choose(V, device, plan)                      # at load: the pinned or faster apply path
    rows = masks.rows(chunks)                          # [(row, GrammarState)], matchers synced
    masks.states.forget(finished_request_ids)          # matchers live as long as their requests
    bitmask = masks.fill(rows, len(chunks), V)         # int32 [M, ceil(V / 32)], 1 = allowed
    masks.apply(logits, bitmask, rows)                 # logits[row, t] = -inf where bit t is 0

Filling runs xgrammar's BatchGrammarMatcher over torch's thread count. Applying touches the listed rows
only, so unconstrained rows cost nothing, by one of two paths that compute the same thing:
- "xgrammar": the library's kernel for the device (C++ on CPU, Triton on CUDA);
- "unpacked": the bits unpacked to a bool [k, V] (numpy on CPU, shifts on the device), then one
  torch.where into the logits.
Which is faster depends on the machine and on how sparse the masks are (the C++ kernel slows down as
more tokens are masked, and most grammar steps allow a few tokens), so `choose` times both at the
real shape at load with the execution plan's timer (services/common/plan.py), unless pinned. On a
2-core Zen 4 with SmolLM2's 49,152 tokens and 64 rows of schema masks: unpacked 1.3 ms, xgrammar 8.2 ms.
Filling those 64 rows takes ~0.5-1.5 ms.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr

from services.common.plan import AUTO, REPS, ExecutionPlan, Timing, fastest, pick
from services.decoder.engine.step import ScheduledChunk
from services.decoder.grammar.state import GrammarState, GrammarStates

log = logging.getLogger("tessera.decoder.grammar")

APPLY_PATHS = ("unpacked", "xgrammar")
_NEG_INF = float("-inf")


def apply_xgrammar(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=logits.shape[1], indices=indices)


def apply_unpacked(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    vocab = logits.shape[1]
    if logits.device.type == "cpu":
        # Little-endian int32 words -> bytes -> bits in token order.
        allowed = torch.from_numpy(np.unpackbits(bitmask[indices].numpy().view(np.uint8), axis=1,
                                                 bitorder="little")).view(torch.bool)[:, :vocab]
    else:
        words = bitmask[indices].to(logits.device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().view(len(indices), -1)[:, :vocab]
    neg = torch.tensor(_NEG_INF, dtype=logits.dtype, device=logits.device)
    if len(indices) == logits.shape[0]:
        torch.where(allowed, logits, neg, out=logits)
    else:
        rows = torch.tensor(indices, device=logits.device)
        logits[rows] = torch.where(allowed, logits[rows], neg)


_APPLY = {"unpacked": apply_unpacked, "xgrammar": apply_xgrammar}


def _probe_mask(rows: int, vocab_size: int) -> torch.Tensor:
    """Masks shaped like a schema's: most rows allow a handful of tokens, some nearly all."""
    gen = np.random.default_rng(0)
    allowed = np.zeros((rows, vocab_size), dtype=bool)
    for r in range(rows):
        if r % 4 == 0:
            allowed[r] = True
            allowed[r, gen.integers(0, vocab_size, 64)] = False
        else:
            allowed[r, gen.integers(0, vocab_size, 12)] = True
    words = -(-vocab_size // 32)
    padded = np.zeros((rows, words * 32), dtype=bool)
    padded[:, :vocab_size] = allowed
    return torch.from_numpy(np.packbits(padded, axis=1, bitorder="little").view("<i4").astype(np.int32))


class GrammarMasks:
    def __init__(self, apply_path: str = "unpacked"):
        if apply_path not in _APPLY:
            raise ValueError(f"grammar mask path must be one of {APPLY_PATHS}, got {apply_path!r}")
        self.apply_path = apply_path
        self._batch: xgr.BatchGrammarMatcher | None = None
        self.states = GrammarStates()      # request_id -> its matcher

    def choose(self, vocab_size: int, device: torch.device | str, record: ExecutionPlan | None = None,
               rows: int = 64, reps: int = REPS) -> str:
        """The apply path (the choice "grammar_mask" of record): the pinned one, else both timed on
        [rows, vocab_size] fp32 logits on device (plan.fastest; unpacked kept on a tie). Keeps and returns it."""
        record = record if record is not None else ExecutionPlan()
        pin = record.pinned("grammar_mask")
        if pin != AUTO:
            self.apply_path = pin
            record.record("grammar_mask", pin)
            return pin
        bitmask = _probe_mask(rows, vocab_size)
        logits = torch.zeros(rows, vocab_size, device=device)
        indices = list(range(rows))
        # Applying a mask again to the logits it has masked does the same work: no copy per call.
        sync = torch.cuda.synchronize if logits.device.type == "cuda" else None
        took = fastest({name: (lambda fn=fn: fn(logits, bitmask, indices)) for name, fn in _APPLY.items()},
                       reps, sync=sync)
        self.apply_path = pick(took, "unpacked")
        record.record("grammar_mask", self.apply_path, [Timing(k, v, rows) for k, v in took.items()],
                      f"at [{rows}, {vocab_size}] on {device}")
        return self.apply_path

    def rows(self, chunks: Sequence[ScheduledChunk]) -> list[tuple[int, GrammarState]]:
        """(row, state) of every chunk whose request has a grammar, each matcher synced to its outputs."""
        found = []
        for i, c in enumerate(chunks):
            state = self.states.of(c)
            if state is not None:
                state.sync(c.output_token_ids)
                found.append((i, state))
        return found

    def fill(self, rows: list[tuple[int, GrammarState]], num_rows: int, vocab_size: int) -> torch.Tensor:
        """int32 [num_rows, ceil(vocab_size / 32)] on CPU: the listed rows' masks, every other row all ones.

        A row the library fails on (a bug, not an input: inputs were checked when compiled) is left
        allowing only the stop tokens, so its choice ends and the engine, and every other request,
        runs on."""
        bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)
        fresh = [(i, s) for i, s in rows if s.next_mask is None and not s.broken]
        one_by_one = [(i, s) for i, s in rows if s.next_mask is not None or s.broken]
        if len(fresh) > 1:
            try:
                self._fill_batch(fresh, bitmask)
            except Exception:  # noqa: BLE001 - a grammar must not take the engine down
                log.exception("batched grammar mask failed; filling the rows one by one")
                one_by_one += fresh
        else:
            one_by_one += fresh
        for i, state in one_by_one:
            try:
                state.fill(bitmask[i])
            except Exception:  # noqa: BLE001 - as above, for this row alone
                log.exception("grammar mask failed after %d tokens; ending the choice", state.num_accepted)
                bitmask[i] = 0
        indices = [i for i, _ in rows]
        for (i, state), dead in zip(rows, (~bitmask[indices].any(dim=1)).tolist(), strict=True):
            if dead:
                # Nothing allowed (a failure above, or a grammar only banned special tokens could go on
                # with): allow the stop rather than draw from a row of -inf; the matcher refuses it and
                # the choice ends.
                log.error("grammar allows no token after %d tokens; ending the choice", state.num_accepted)
                bitmask[i] = ~state.grammar.bits.no_stop
        return bitmask

    def _fill_batch(self, fresh: list[tuple[int, GrammarState]], bitmask: torch.Tensor) -> None:
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max(1, torch.get_num_threads()))
        self._batch.batch_fill_next_token_bitmask([s.matcher for _, s in fresh], bitmask, [i for i, _ in fresh])
        banned: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for i, state in fresh:
            ban = state.grammar.ban
            banned.setdefault(id(ban), (ban, []))[1].append(i)
        for ban, indices in banned.values():      # one AND per vocabulary's ban row, over all its rows
            bitmask[indices] &= ban

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[tuple[int, GrammarState]]) -> None:
        """logits [M, V] fp32, in place: disallowed tokens of the listed rows -> -inf."""
        _APPLY[self.apply_path](logits, bitmask, [i for i, _ in rows])
