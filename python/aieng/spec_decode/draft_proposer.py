"""The engine's side of the `draft_model` proposer: the draft model runs on the device next to
the target (`aieng.worker.draft_model.DraftModel`, held by the ModelRunner) and its proposals
come back with each step's output; this proposer hands each request the ones made for its
slot."""

from __future__ import annotations

from collections.abc import Sequence

from aieng.spec_decode.proposer import ProposalRequest


class DraftModelProposer:
    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens
        self.latest: dict[int, list[int]] = {}  # slot -> the draft model's tokens

    def receive(self, drafts: dict[int, list[int]] | None) -> None:
        """The proposals of the step just run (they replace the previous step's)."""
        self.latest = drafts or {}

    def propose(self, requests: Sequence[ProposalRequest]) -> list[list[int]]:
        return [self.latest.get(r.slot, [])[: min(self.k, r.max_tokens)] for r in requests]
