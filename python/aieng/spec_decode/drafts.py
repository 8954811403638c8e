"""The engine's side of speculative decoding: after each step it asks the proposer for the
drafts of the requests that decoded and hands them to the core, and it counts what the
verification accepted (vLLM's figures: drafts, draft tokens, accepted tokens, accepted
tokens per draft position)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aieng.spec_decode.config import SpeculativeConfig
from aieng.spec_decode.ngram import NgramProposer
from aieng.spec_decode.proposer import ProposalRequest, Proposer
from aieng.spec_decode.verify import sampling_groups


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
    raise ValueError(f"speculative_config: no proposer for method {config.method!r}")


class SpeculativeDecoding:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.proposer = make_proposer(config)
        self.num_drafts = 0  # sampling requests that verified at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = np.zeros(config.num_speculative_tokens, np.int64)

    def wanted(self, num_running: int) -> bool:
        """Whether a step with `num_running` running requests speculates."""
        limit = self.config.disable_by_batch_size
        return limit == 0 or num_running <= limit

    def propose(self, requests: Sequence[ProposalRequest]) -> list[list[int]]:
        return self.proposer.propose(requests)

    def record(self, sample_request_rows: np.ndarray, num_sampled: np.ndarray) -> None:
        """Counts a verified step: a request with d drafts that took n tokens accepted n - 1
        of them (its tokens before the last are drafts it accepted)."""
        _, sizes = sampling_groups(sample_request_rows)
        drafted = sizes - 1
        speculating = drafted > 0
        if not speculating.any():
            return
        accepted = np.minimum(np.asarray(num_sampled, np.int64) - 1, drafted)[speculating]
        self.num_drafts += int(speculating.sum())
        self.num_draft_tokens += int(drafted.sum())
        self.num_accepted_tokens += int(accepted.sum())
        positions = np.arange(len(self.accepted_per_position))
        self.accepted_per_position += (positions[None, :] < accepted[:, None]).sum(axis=0)
