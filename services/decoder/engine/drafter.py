"""Prompt-lookup drafting: propose the tokens that followed an earlier occurrence of the context's
last n-gram. No torch, no model: the proposal costs one scan of the request's own tokens. And the gate
that stops proposing for a request whose drafts do not pay for their verification (DraftGate)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class NgramDrafter:
    """Proposals for one request at a time, from its prompt + output tokens.

    For n from max_n down to min_n, the last n tokens are searched for in the earlier tokens,
    most recent occurrence first (the nearest context is the likeliest to repeat: a quoted
    paragraph is followed where the quote left off). The first hit proposes up to `limit` of the
    tokens after it; none found proposes nothing. Tokens in `stop_ids` end a proposal before
    them: a draft never carries a stop token, so an accepted run can only end at its last
    (sampled) token, as without speculation.
    """

    def __init__(self, max_n: int, min_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, tokens: Sequence[int], limit: int, stop_ids: frozenset[int] = frozenset()) -> list[int]:
        """Up to `limit` draft tokens to follow tokens[-1]; [] when no n-gram repeats or limit < 1."""
        if limit < 1:
            return []
        seq = list(tokens)
        end = len(seq)
        # Searched on the reversed sequence, so that list.index (a scan in C) walks from the most
        # recent token backwards: an occurrence seq[i:i+n] is rev[j:j+n] with j = end - i - n, and
        # j >= 1 keeps it clear of the suffix itself with at least one token after it.
        rev = seq[::-1]
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            pattern = rev[:n]
            j = 1
            while j <= end - n:
                try:
                    j = rev.index(pattern[0], j, end - n + 1)
                except ValueError:
                    break
                if rev[j:j + n] == pattern:
                    i = end - j - n
                    draft = seq[i + n:i + n + limit]
                    for k, t in enumerate(draft):
                        if t in stop_ids:
                            return draft[:k]
                    return draft
                j += 1
        return []


@dataclass(frozen=True)
class VerifyCost:
    """What verifying drafts costs: seconds[k] is a one-request decode step carrying k drafts (1 + k rows),
    k = 0..max, measured at load (runner/verify_cost.py)."""

    seconds: tuple[float, ...]

    def __post_init__(self):
        if not self.seconds or min(self.seconds) <= 0:
            raise ValueError(f"verify costs must be positive seconds, got {self.seconds}")

    def extra_steps(self, drafts: int) -> float:
        """The one-row steps a step with `drafts` drafts costs beyond a plain decode step (>= 0)."""
        return max(0.0, self.seconds[min(drafts, len(self.seconds) - 1)] / self.seconds[0] - 1)

    def steps(self, seconds: float) -> float:
        """`seconds` of work in one-row decode steps."""
        return seconds / self.seconds[0]


@dataclass
class DraftRecord:
    """One request's drafting so far: its running net gain per attempt, and when it may draft again."""

    attempts: int = 0           # attempts since it last (re)started drafting
    gain: float = 0.0           # running mean of tokens gained per attempt, in one-row steps
    resume_at: int = 0          # the scheduler step from which it drafts again
    pause: int = 0              # steps of its last pause (doubles while drafting keeps not paying)
    scan_s: float = 0.0         # seconds the last proposal's scan took, until its verify is seen
    num_pauses: int = 0
    # Each draft token's chance of acceptance once the ones before it were accepted, as decayed counts (KEEP):
    # hits (tokens accepted) over trials (those, plus the first rejected token of each verify).
    hits: float = 0.0
    trials: float = 0.0


class DraftGate:
    """Per request, whether drafting pays (docs/design.md, speculative decoding).

    Each attempt (a proposal scan, and the verify step when it proposed drafts) gains
    accepted - extra_steps(drafted) - steps(scan) tokens over a plain decode step: an accepted draft is a
    token without a step of its own; the verify rows and the scan cost time a plain step does not spend.
    The gain's running mean (KEEP of the past) is judged after WARMUP attempts: below 0, the request stops
    proposing for a pause of FIRST_PAUSE steps, doubled at each pause in a row up to MAX_PAUSE, then tries
    WARMUP attempts again (a reply may start quoting later). The gate only decides whether a request
    proposes; what is proposed and how it is verified are unchanged, so greedy outputs stay those of decoding
    without drafts, token for token."""

    WARMUP = 4
    KEEP = 0.75
    FIRST_PAUSE = 16
    MAX_PAUSE = 1024

    def __init__(self, cost: VerifyCost):
        self.cost = cost
        self.num_pauses = 0         # pauses begun, over every request

    @staticmethod
    def wants(record: DraftRecord, step: int) -> bool:
        return step >= record.resume_at

    def length(self, record: DraftRecord, limit: int) -> int:
        """How many drafts to propose, at most `limit`: the k >= 1 with the most expected net tokens, p + p^2 +
        ... + p^k - extra_steps(k), for p the request's acceptance so far (1 before any verify). Where verify
        rows cost little (a 2-row step about a 1-row one), a request that drafts badly keeps drafting one or two
        tokens cheaply rather than four; the pause still stops one whose drafts do not pay at all."""
        p = record.hits / record.trials if record.trials else 1.0
        best, best_gain, expected = 1, -float("inf"), 0.0
        for k in range(1, limit + 1):
            expected += p ** k
            gain = expected - self.cost.extra_steps(k)
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def observe(self, record: DraftRecord, step: int, drafted: int, accepted: int, scan_s: float) -> None:
        """One attempt at scheduler step `step`: `drafted` drafts proposed (0: the scan found none), `accepted`
        of them accepted, the scan taking scan_s seconds."""
        if drafted:
            record.hits = self.KEEP * record.hits + accepted
            record.trials = self.KEEP * record.trials + accepted + (accepted < drafted)
        net = accepted - self.cost.extra_steps(drafted) - self.cost.steps(scan_s)
        record.gain = net if record.attempts == 0 else self.KEEP * record.gain + (1 - self.KEEP) * net
        record.attempts += 1
        if record.attempts < self.WARMUP:
            return
        if record.gain < 0:
            record.pause = min(self.MAX_PAUSE, 2 * record.pause if record.pause else self.FIRST_PAUSE)
            record.resume_at = step + 1 + record.pause
            record.attempts, record.gain = 0, 0.0
            record.num_pauses += 1
            self.num_pauses += 1
        else:
            record.pause = 0
