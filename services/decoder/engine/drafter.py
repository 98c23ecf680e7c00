"""Prompt-lookup drafting: propose the tokens that followed an earlier occurrence of the context's
last n-gram. No torch, no model: the proposal costs one scan of the request's own tokens."""
from __future__ import annotations

from collections.abc import Sequence


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
