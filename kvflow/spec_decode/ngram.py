"""Prompt lookup: draft tokens copied from the request's own history (no extra model).

If the last n tokens also occurred earlier in the sequence, the tokens that followed that
earlier occurrence are a good guess for what follows now: summaries, edits and code
completion repeat long spans of their input. Longer n-grams are tried first (a longer
match is a more specific context); among equal matches the most recent wins (it is the
closest context). Matching is vectorised with numpy over the whole sequence.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvflow.spec_decode.proposer import Proposer


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[np.ndarray], max_drafts: list[int],
                req_ids: list[str] | None = None, params=None) -> list[list[int]]:
        return [self.propose_one(t, min(m, self.num_speculative_tokens))
                for t, m in zip(token_ids, max_drafts)]

    def propose_one(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest
        suffix n-gram (min_n <= n <= max_n) of ``tokens``; [] when none recurs."""
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]
            # Windows starting at 0 .. length-n-1: every earlier n-gram, not the suffix.
            windows = sliding_window_view(tokens[:length - 1], n)  # [length - n, n]
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start: start + k].tolist()
        return []
