"""The one interface of a proposer: the tokens a request may continue with.

A proposer sees each decoding request's tokens (prompt, then output) and proposes up to
`max_tokens` that may follow; the engine hands them to the core, and the next target forward
verifies them. Proposals never change the output, only how many tokens a forward yields, so
a proposer may be as cheap or as wrong as it likes. A new kind (a draft model, an EAGLE
head) is one more class here, chosen by `speculative_config["method"]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class ProposalRequest:
    request_id: str
    token_ids: np.ndarray  # (L,) int64: the prompt, then the output so far
    max_tokens: int  # propose at most this many
    slot: int = -1  # the request's row on the device (a draft model proposes by slot)


class Proposer(Protocol):
    def propose(self, requests: Sequence[ProposalRequest]) -> list[list[int]]:
        """Draft tokens for each request, in order (possibly none)."""
        ...
