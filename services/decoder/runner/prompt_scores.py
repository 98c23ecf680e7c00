"""Prompt logprobs (vLLM's prompt_logprobs): every prompt token scored by the logits of the position before it.

A chunk at start s whose request asks (ScheduledChunk.prompt_logprobs = k) has its rows at positions s, s + 1, ...;
the row at position p predicts token p + 1, so the rows up to the prompt's second-to-last position score prompt
tokens s + 1 onward (the prompt's last row predicts the first generated token, which the sampler handles). Chunked
prefill needs nothing more: each chunk scores its own rows, and the engine appends them in order
(services/decoder/engine/request.py).

The values are log_softmax of the raw model logits, before logit_bias, penalties and temperature, as the
sampler's logprobs are (runner/sampler.py). The LM head runs over at most PIECE_ELEMENTS / vocab rows at a time,
and only the scored token's value, its rank and the top-k survive each piece: a long prompt never holds
[T, vocab] logits.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from services.decoder.engine.step import PromptLogprob, ScheduledChunk

# fp32 logits per piece (64 MiB), plus as much again for their log_softmax.
PIECE_ELEMENTS = 1 << 24


def score_prompts(hidden: torch.Tensor, chunks: Sequence[ScheduledChunk],
                  logits: Callable[[torch.Tensor], torch.Tensor], vocab_size: int) -> dict[str, list[PromptLogprob]]:
    """hidden [N, hidden]: the step's final hidden states, chunk after chunk in step order; logits: the model's
    head, [R, hidden] -> fp32 [R, vocab_size]. Returns request_id -> its chunk's PromptLogprobs, for each chunk
    that asks (an empty list for a chunk with no row inside the prompt's scored span)."""
    out: dict[str, list[PromptLogprob]] = {}
    piece = max(1, PIECE_ELEMENTS // vocab_size)
    offset = 0
    for c in chunks:
        n = len(c.token_ids)
        if c.prompt_logprobs is not None:
            rows = max(0, min(c.start + n, c.num_prompt_tokens - 1) - c.start)
            targets = list(c.prompt_token_ids[c.start + 1:c.start + 1 + rows])
            out[c.request_id] = [entry for first in range(0, rows, piece)
                                 for entry in _score(hidden[offset + first:offset + min(first + piece, rows)],
                                                     targets[first:first + piece], c.prompt_logprobs, logits)]
        offset += n
    return out


def _score(hidden: torch.Tensor, targets: list[int], top: int,
           logits: Callable[[torch.Tensor], torch.Tensor]) -> list[PromptLogprob]:
    """hidden [p, hidden] rows, targets [p] the tokens they predict -> p PromptLogprobs with top-`top`."""
    lp = torch.log_softmax(logits(hidden).float(), dim=-1)                         # [p, V]
    ids = torch.tensor(targets, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])                                            # [p, 1]
    ranks = (lp > chosen).sum(dim=1) + 1
    alternatives: list[tuple[tuple[int, float], ...]] = [()] * len(targets)
    if top:
        values, top_ids = torch.topk(lp, min(top, lp.shape[1]))
        alternatives = [tuple(zip(i, v, strict=True)) for i, v in zip(top_ids.tolist(), values.tolist(), strict=True)]
    return [PromptLogprob(token, value, rank, alt) for token, value, rank, alt
            in zip(targets, chosen[:, 0].tolist(), ranks.tolist(), alternatives, strict=True)]
