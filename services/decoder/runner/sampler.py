"""Next-token choice for the sampled rows of a step.

Order of application (vLLM v1's sampler):
  0. structured outputs: a constrained row's disallowed tokens -> -inf, in place on the raw logits
     (services/decoder/grammar/mask.py; vLLM also masks before its sampler). EOS is allowed only
     where the grammar may end. Where the grammar allows nothing but a stop token, step 1 does not
     block it: a complete grammar ends the choice even before min_tokens;
  on the logits [M, V], every row at once (`process_logits`):
    1. blocked ids -> -inf: the stop tokens while a request's min_tokens is unmet (the engine
       names them in ScheduledChunk.blocked_token_ids);
    2. logit_bias: logit[t] += bias[t];
    3. repetition penalty over the prompt's and the generated tokens (HF and vLLM semantics:
       a positive logit is divided by the penalty, a negative one multiplied);
    4. presence/frequency penalties over the generated tokens, as OpenAI defines them:
       logit -= frequency * count + presence * [count > 0];
  then greedy rows (temperature 0) take the argmax of that; the others, one row at a time
  (`warp_logits`, then the draw):
    5. divide by the temperature;
    6. min_p: drop tokens whose probability is below min_p times the most likely one's;
    7. top-k, then the top-p nucleus (over what min_p left);
    8. draw from the softmax.

Seeded requests are reproducible whatever else is in the batch: steps 1-4 are elementwise
within a row (the batch only decides which rows they touch), steps 5-8 run on one row alone,
and each draw uses its own torch.Generator seeded from (seed, number of tokens generated so
far). The generator is derived, not stored, so preemption, recompute and finished requests
leave no state.

Logprobs are log_softmax of the raw model logits (before the grammar, bias, penalties, temperature
and filtering), the same choice as vLLM's default: they describe the model, not the sampler (a
grammar-forced token may carry a low logprob).

After the draw, each constrained row's matcher accepts its token; SampledToken.complete tells the
engine that the grammar is complete (only a stop could follow), so the choice ends with "stop".

Speculative decoding (`Sampler.run`): a chunk with d drafts has d + 1 rows, verified in order.
Row j is sampled exactly as a chunk without drafts would be at that point: its outputs so far are
the chunk's plus the drafts accepted before it (penalties, the seed's per-token stream), and its
grammar matcher has accepted just those. Draft j is accepted when the token sampled at row j is
that draft; the first sampled token that is not (or the bonus row after the last draft) ends the
run. For greedy rows that is "accept while the draft is the argmax". For temperature > 0 it is
the speculative-sampling rule for a point-mass draft distribution, in its coupled form: with p the
target distribution after temperature, min_p, top-k and top-p, P(accept draft t) = p(t), and on
rejection the token emitted is distributed as p(x) / (1 - p(t)) for x != t, which is p with t
removed and renormalised; the output distribution is p at every position. Drawing it this way
also keeps seeded outputs the same as with speculation off, token for token (the same per-token
seed draws at the same position from the same distribution). The grammar is never rolled back:
it only ever accepts the tokens emitted, and a draft it forbids has p = 0, so it is rejected.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from services.common.errors import InvalidArgument
from services.decoder.engine.step import SampledToken, SamplingParams, ScheduledChunk
from services.decoder.grammar.mask import GrammarMasks
from services.decoder.grammar.state import clear_bits

_MASK64 = (1 << 64) - 1


def categorical(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from probs [V] (non-negative, any positive sum) by inverting the CDF.

    torch.multinomial takes ~24 ms for one sample over a 49,152-token vocabulary on CPU
    (it races exponentials over every entry); one uniform and a binary search over the fp64
    cumulative sum take ~0.05 ms. Searching right of u*total never lands on a zero entry
    (its CDF step is flat), and the clamp covers u*total rounding up to the total.
    """
    cdf = torch.cumsum(probs.double(), 0)
    u = torch.rand((), dtype=torch.float64, generator=generator) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True))
    if index >= cdf.shape[0]:
        index = int(torch.nonzero(probs)[-1])
    return index


def draw_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): decorrelated per-step seeds from one request seed."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1          # manual_seed wants a non-negative int63


def _index(pairs: list[tuple[int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    rows, ids = zip(*pairs, strict=True)
    return torch.tensor(rows, device=device), torch.tensor(ids, device=device)


def _block(logits: torch.Tensor, chunks: list[ScheduledChunk], exempt: frozenset[int]) -> None:
    vocab = logits.shape[1]
    pairs = [(i, t) for i, c in enumerate(chunks) if i not in exempt for t in c.blocked_token_ids if 0 <= t < vocab]
    if pairs:
        logits[_index(pairs, logits.device)] = float("-inf")


def _bias(logits: torch.Tensor, chunks: list[ScheduledChunk]) -> None:
    vocab = logits.shape[1]
    pairs, values = [], []
    for i, c in enumerate(chunks):
        for t, b in c.sampling.logit_bias:
            if 0 <= t < vocab:
                pairs.append((i, t))
                values.append(b)
    if pairs:
        # Ids are distinct per row (a map on the wire), so no two adds meet in one element.
        logits.index_put_(_index(pairs, logits.device),
                          torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)


def _pairs(logits: torch.Tensor, rows: list[int], ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) tensors over every id of ids[r] for row rows[r], ids outside [0, V) left out.
    The penalties touch only these elements, not whole [M, V] rows."""
    row = torch.cat([torch.full((len(t),), r, dtype=torch.long) for r, t in zip(rows, ids, strict=True)])
    tok = torch.cat(ids)
    keep = (tok >= 0) & (tok < logits.shape[1])
    return row[keep].to(logits.device), tok[keep].to(logits.device)


def _ids(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long)


def _repetition(logits: torch.Tensor, chunks: list[ScheduledChunk]) -> None:
    rows = [i for i, c in enumerate(chunks) if c.sampling.repetition_penalty != 1.0]
    if not rows:
        return
    row, tok = _pairs(logits, rows, [torch.cat([_ids(chunks[i].prompt_token_ids), _ids(chunks[i].output_token_ids)])
                                     for i in rows])
    penalty = torch.tensor([c.sampling.repetition_penalty for c in chunks], dtype=logits.dtype,
                           device=logits.device)[row]
    # A token seen twice is written twice with the same value, so duplicates need no unique().
    values = logits[row, tok]
    logits[row, tok] = torch.where(values > 0, values / penalty, values * penalty)


def _presence_frequency(logits: torch.Tensor, chunks: list[ScheduledChunk]) -> None:
    rows = [i for i, c in enumerate(chunks)
            if c.output_token_ids and (c.sampling.presence_penalty or c.sampling.frequency_penalty)]
    if not rows:
        return
    row, tok = _pairs(logits, rows, [_ids(chunks[i].output_token_ids) for i in rows])
    keys, counts = torch.unique(row * logits.shape[1] + tok, return_counts=True)
    row, tok = keys // logits.shape[1], keys % logits.shape[1]
    frequency = torch.tensor([c.sampling.frequency_penalty for c in chunks], dtype=logits.dtype,
                             device=logits.device)[row]
    presence = torch.tensor([c.sampling.presence_penalty for c in chunks], dtype=logits.dtype,
                            device=logits.device)[row]
    logits[row, tok] -= frequency * counts.to(logits.dtype) + presence


def _modifies(c: ScheduledChunk) -> bool:
    p = c.sampling
    return bool(c.blocked_token_ids or p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty
                or p.frequency_penalty)


def process_logits(logits: torch.Tensor, chunks: list[ScheduledChunk],
                   exempt: frozenset[int] = frozenset()) -> torch.Tensor:
    """Steps 1-4 of the module docstring. logits [M, V] raw, one row per chunk -> [M, V].
    Rows in exempt skip step 1 (a grammar that can only stop there).

    Returns logits itself when no row asks for any of them, else a modified copy (the raw logits
    stay intact for the logprobs).
    """
    if not any(_modifies(c) for c in chunks):
        return logits
    out = logits.clone()
    _block(out, chunks, exempt)
    _bias(out, chunks)
    _repetition(out, chunks)
    _presence_frequency(out, chunks)
    return out


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


def warp_logits(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Steps 5-7 for one non-greedy row: row [V] (processed) -> [V] logits to draw from."""
    row = row / p.temperature
    if p.min_p > 0:
        # p_t >= min_p * p_max  <=>  logit_t - logit_max >= log(min_p): the same cut as on the
        # softmax, without one; the best token always stays (log(min_p) <= 0).
        row = row.masked_fill(row < row.max() + math.log(p.min_p), float("-inf"))
    return filter_logits(row, p.top_k, p.top_p)


def check_sampling(p: SamplingParams) -> None:
    """Refuse parameters the sampler cannot apply (the server validates first; this guards the runner)."""
    if not p.temperature >= 0:
        raise InvalidArgument("temperature must be >= 0", param="temperature")
    if not 0 < p.top_p <= 1:
        raise InvalidArgument("top_p must be in (0, 1]", param="top_p")
    if not 0 <= p.min_p <= 1:
        raise InvalidArgument("min_p must be in [0, 1]", param="min_p")
    if not p.repetition_penalty > 0:
        raise InvalidArgument("repetition_penalty must be > 0", param="repetition_penalty")


class Sampler:
    def __init__(self, seed: int | None = None):
        # Unseeded requests draw from one runner-wide stream.
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.grammars = GrammarMasks()

    def __call__(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[SampledToken]:
        """logits [M, V] fp32 for M sampled chunks -> one SampledToken per chunk, same order.
        Constrained rows of logits are masked in place (after the raw logprobs are taken)."""
        for c in chunks:
            check_sampling(c.sampling)
        want_logprobs = [c.sampling.logprobs is not None for c in chunks]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        constrained = self.grammars.rows(chunks)
        exempt = frozenset()
        if constrained:
            bitmask = self.grammars.fill(constrained, len(chunks), logits.shape[1])
            self.grammars.apply(logits, bitmask, constrained)
            exempt = frozenset(i for i, _ in constrained if chunks[i].blocked_token_ids
                               and not bool(clear_bits(bitmask[i], chunks[i].blocked_token_ids).any()))
        processed = process_logits(logits, chunks, exempt)
        greedy = [c.sampling.temperature == 0 for c in chunks]
        # max(dim).indices is argmax (the first of tied maxima, a NaN where one is) at 2.5x the speed
        # of torch.argmax on [64, 49152] fp32 rows (0.9 against 2.3 ms, 2 threads; ~5% of a 64-row bf16 step).
        argmax = processed.max(dim=-1).indices.tolist() if any(greedy) else None
        results = []
        for i, c in enumerate(chunks):
            token = argmax[i] if greedy[i] else self._draw(processed[i], c)
            results.append(self._answer(token, raw_logprobs[i] if want_logprobs[i] else None, c.sampling))
        for i, state in constrained:
            results[i].complete = state.advance(results[i].token_id)
        return results

    def run(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[list[SampledToken]]:
        """Verify drafts: logits [R, V], chunk i owning 1 + len(draft_token_ids) consecutive rows in
        chunk order -> the tokens each chunk emits, 1 to len(drafts) + 1 of them (module docstring)."""
        if not any(c.draft_token_ids for c in chunks):
            return [[t] for t in self(logits, chunks)]
        first = [0]
        for c in chunks:
            first.append(first[-1] + len(c.draft_token_ids) + 1)
        if first[-1] != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows for {first[-1]} sampled positions")
        runs: list[list[SampledToken]] = [[] for _ in chunks]
        alive = list(range(len(chunks)))
        position = 0
        while alive:
            # Row `position` of every chunk still verifying, as the chunk it would have been
            # without speculation: its outputs extended by the drafts accepted so far.
            rows = torch.tensor([first[i] + position for i in alive], device=logits.device)
            view = [chunks[i] if not runs[i] else replace(
                chunks[i], output_token_ids=chunks[i].output_token_ids + [t.token_id for t in runs[i]])
                for i in alive]
            going = []
            for i, tok in zip(alive, self(logits.index_select(0, rows), view), strict=True):
                runs[i].append(tok)
                drafts = chunks[i].draft_token_ids
                if position < len(drafts) and tok.token_id == drafts[position] and not tok.complete:
                    going.append(i)
            alive = going
            position += 1
        return runs

    @staticmethod
    def plain_greedy(chunks: list[ScheduledChunk]) -> bool:
        """Whether every chunk takes the argmax of its raw logits and nothing else of them: temperature 0,
        no logprobs, no grammar, none of steps 1-4. Such a step needs only each row's argmax, which the
        runner may get without the full logits (model/screen.py)."""
        return all(c.sampling.temperature == 0 and c.sampling.logprobs is None and c.grammar is None
                   and not _modifies(c) for c in chunks)

    @staticmethod
    def greedy_runs(tokens: list[int], chunks: list[ScheduledChunk]) -> list[list[SampledToken]]:
        """`run` for a plain_greedy step from each row's argmax (tokens, one per row as in run's logits):
        a chunk's drafts are accepted while each is its row's argmax, then the next argmax is emitted."""
        for c in chunks:
            check_sampling(c.sampling)
        positions = sum(len(c.draft_token_ids) + 1 for c in chunks)
        if positions != len(tokens):
            raise ValueError(f"{len(tokens)} argmax rows for {positions} sampled positions")
        runs, row = [], 0
        for c in chunks:
            run = [SampledToken(tokens[row])]
            for j, draft in enumerate(c.draft_token_ids):
                if run[-1].token_id != draft:
                    break
                run.append(SampledToken(tokens[row + j + 1]))
            runs.append(run)
            row += len(c.draft_token_ids) + 1
        return runs

    def _draw(self, row: torch.Tensor, c: ScheduledChunk) -> int:
        p = c.sampling
        # Drawn on CPU with CPU generators, so a seed gives the same tokens on every device.
        probs = torch.softmax(warp_logits(row, p), dim=-1).cpu()
        if p.seed is None:
            generator = self.generator
        else:
            generator = torch.Generator()
            generator.manual_seed(draw_seed(p.seed, len(c.output_token_ids)))
        return categorical(probs, generator)

    @staticmethod
    def _answer(token: int, logprobs: torch.Tensor | None, p: SamplingParams) -> SampledToken:
        if logprobs is None:
            return SampledToken(token)
        top = []
        if p.logprobs:
            values, ids = torch.topk(logprobs, min(p.logprobs, logprobs.shape[0]))
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        return SampledToken(token, float(logprobs[token]), top)
