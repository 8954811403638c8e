"""Prompt lookup (n-gram) proposals: find the request's last n tokens earlier in its own
tokens and propose what followed them there, the longest n first (prompt_lookup_max down to
prompt_lookup_min), the latest earlier occurrence of that n-gram first. Pays off where the
output copies its input: summaries, edits, code, quoting.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from aieng.spec_decode.proposer import ProposalRequest


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int):
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, requests: Sequence[ProposalRequest]) -> list[list[int]]:
        return [self.propose_one(r.token_ids, min(self.k, r.max_tokens)) for r in requests]

    def propose_one(self, tokens: np.ndarray, k: int) -> list[int]:
        """tokens (L,): up to k tokens that followed the latest earlier match of the longest
        suffix n-gram (n in [lookup_min, lookup_max]); [] when none matches."""
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            suffix = tokens[length - n :]
            # Windows starting at 0 .. L - n - 1: every n-gram but the suffix itself.
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
