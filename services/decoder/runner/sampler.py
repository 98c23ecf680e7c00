"""Next-token choice for the sampled rows of a step.

Order per row: penalties (presence/frequency over the request's own output tokens, as
OpenAI defines them: logit -= frequency * count + presence * [count > 0]); then greedy
(temperature 0) takes the argmax, while the others divide by temperature, keep the top-k
and the top-p nucleus, and draw from the softmax.

Seeded requests are reproducible whatever else is in the batch: each draw uses its own
torch.Generator seeded from (seed, number of tokens generated so far). The generator is
derived, not stored, so preemption, recompute and finished requests leave no state.

Logprobs are log_softmax of the raw model logits (before penalties, temperature and
filtering), the same choice as vLLM's default: they describe the model, not the sampler.
"""
from __future__ import annotations

import torch

from services.common.errors import InvalidArgument
from services.decoder.engine.step import SampledToken, SamplingParams, ScheduledChunk

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): decorrelated per-step seeds from one request seed."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1          # manual_seed wants a non-negative int63


def apply_penalties(logits: torch.Tensor, output_ids: list[int], p: SamplingParams) -> torch.Tensor:
    """logits [V] (modified in place and returned)."""
    if not output_ids or (p.presence_penalty == 0 and p.frequency_penalty == 0):
        return logits
    counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=logits.shape[0])
    counts = counts[:logits.shape[0]].to(logits.dtype)
    logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits with everything outside top-k and the top-p nucleus set to -inf.

    The nucleus is the smallest set of most likely tokens whose probability reaches top_p;
    the most likely token is always kept.
    """
    vocab = logits.shape[0]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs       # mass strictly ahead of each token
        drop = before >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int | None = None):
        # Unseeded requests draw from one runner-wide stream.
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[SampledToken]:
        """logits [M, V] fp32 for M sampled chunks -> one SampledToken per chunk, same order."""
        want_logprobs = [c.sampling.logprobs is not None for c in chunks]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        greedy = [c.sampling.temperature == 0 for c in chunks]
        penalised = any(c.sampling.presence_penalty or c.sampling.frequency_penalty for c in chunks)
        tokens = torch.argmax(logits, dim=-1).tolist() if all(greedy) and not penalised else None
        results = []
        for i, c in enumerate(chunks):
            p = c.sampling
            if tokens is not None:
                token = tokens[i]
            else:
                row = apply_penalties(logits[i].clone(), c.output_token_ids, p)
                token = self._choose(row, c)
            results.append(self._answer(token, raw_logprobs[i] if want_logprobs[i] else None, p))
        return results

    def _choose(self, row: torch.Tensor, c: ScheduledChunk) -> int:
        p = c.sampling
        if p.temperature < 0:
            raise InvalidArgument("temperature must be >= 0", param="temperature")
        if p.temperature == 0:
            return int(torch.argmax(row))
        if not 0 < p.top_p <= 1:
            raise InvalidArgument("top_p must be in (0, 1]", param="top_p")
        row = filter_logits(row / p.temperature, p.top_k, p.top_p)
        # Drawn on CPU with CPU generators, so a seed gives the same tokens on every device.
        probs = torch.softmax(row, dim=-1).cpu()
        if p.seed is None:
            generator = self.generator
        else:
            generator = torch.Generator()
            generator.manual_seed(draw_seed(p.seed, len(c.output_token_ids)))
        return int(torch.multinomial(probs, 1, generator=generator))

    @staticmethod
    def _answer(token: int, logprobs: torch.Tensor | None, p: SamplingParams) -> SampledToken:
        if logprobs is None:
            return SampledToken(token)
        top = []
        if p.logprobs:
            values, ids = torch.topk(logprobs, min(p.logprobs, logprobs.shape[0]))
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        return SampledToken(token, float(logprobs[token]), top)
