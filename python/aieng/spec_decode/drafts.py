"""The engine's side of speculative decoding: after each step it asks the proposer for the
drafts of the requests that decoded and hands them to the core, and it counts what the
verification accepted (vLLM's figures: drafts, draft tokens, accepted tokens, accepted
tokens per draft position)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aieng.config.speculative import SpeculativeConfig, measured_batch_limit
from aieng.spec_decode.draft_proposer import DraftModelProposer
from aieng.spec_decode.ngram import NgramProposer
from aieng.spec_decode.proposer import ProposalRequest, Proposer
from aieng.worker.spec_verify import sampling_groups

# A request whose drafts were accepted less often than this, over at least JUDGED_AFTER draft
# tokens, proposes only every PROBE_EVERY-th step (its acceptance may come back): its
# rejected drafts cost verification work for nothing.
POOR_ACCEPTANCE = 0.2
JUDGED_AFTER = 16
PROBE_EVERY = 8


@dataclass
class _Record:
    drafted: int = 0
    accepted: int = 0
    skipped: int = 0

    @property
    def poor(self) -> bool:
        return self.drafted >= JUDGED_AFTER and self.accepted < POOR_ACCEPTANCE * self.drafted


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
    if config.method == "draft_model":
        return DraftModelProposer(config.num_speculative_tokens)
    raise ValueError(f"speculative_config: no proposer for method {config.method!r}")


class SpeculativeDecoding:
    def __init__(self, config: SpeculativeConfig, device: str = "cpu"):
        self.config = config
        self.batch_limit = measured_batch_limit(config, device)  # 0: no limit
        self.proposer = make_proposer(config)
        self.num_drafts = 0  # sampling requests that verified at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = np.zeros(config.num_speculative_tokens, np.int64)
        self._records: dict[str, _Record] = {}  # by request id, while it decodes

    def receive(self, drafts: dict[int, list[int]] | None) -> None:
        """A step's output's proposals from the device (the draft model's); no-op otherwise."""
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.receive(drafts)

    def wanted(self, num_running: int) -> bool:
        """Whether a step with `num_running` running requests speculates."""
        return self.batch_limit == 0 or num_running <= self.batch_limit

    def propose(self, requests: Sequence[ProposalRequest]) -> list[list[int]]:
        """Drafts for `requests` (the ones decoding now); a request whose acceptance is poor
        gets none but every PROBE_EVERY-th time."""
        self._records = {r.request_id: self._records.get(r.request_id, _Record()) for r in requests}
        asked: list[int] = []
        for i, r in enumerate(requests):
            record = self._records[r.request_id]
            record.skipped = record.skipped + 1 if record.poor else 0
            if record.skipped % PROBE_EVERY == 0:
                asked.append(i)
        drafts: list[list[int]] = [[] for _ in requests]
        if asked:
            proposed = self.proposer.propose([requests[i] for i in asked])
            for i, draft in zip(asked, proposed, strict=True):
                drafts[i] = draft
        return drafts

    def record(
        self,
        sample_request_rows: np.ndarray,
        num_sampled: np.ndarray,
        request_ids: Sequence[str] | None = None,
    ) -> None:
        """Counts a verified step: a request with d drafts that took n tokens accepted n - 1
        of them (its tokens before the last are drafts it accepted). request_ids: of each
        sampling request, for its own acceptance."""
        _, sizes = sampling_groups(sample_request_rows)
        drafted = sizes - 1
        speculating = drafted > 0
        if not speculating.any():
            return
        taken = np.minimum(np.asarray(num_sampled, np.int64) - 1, drafted)
        if request_ids is not None:
            for g in np.flatnonzero(speculating).tolist():
                record = self._records.get(request_ids[g])
                if record is not None:
                    record.drafted += int(drafted[g])
                    record.accepted += int(taken[g])
        accepted = taken[speculating]
        self.num_drafts += int(speculating.sum())
        self.num_draft_tokens += int(drafted.sum())
        self.num_accepted_tokens += int(accepted.sum())
        positions = np.arange(len(self.accepted_per_position))
        self.accepted_per_position += (positions[None, :] < accepted[:, None]).sum(axis=0)
