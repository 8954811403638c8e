"""The messages across the device boundary: what the engine sends the model runner each step,
and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from aieng.pooling import PoolingParams
from aieng.sampling import SamplingParams

if TYPE_CHECKING:
    from aieng.worker.step_plan import StepPlan


@dataclass(frozen=True)
class NewSamplingRow:
    """A request that took a slot since the last step: its sampling state starts here."""

    slot: int
    params: SamplingParams
    prompt_token_ids: list[int]
    bad_words_ids: list[list[int]] = field(default_factory=list)  # params.bad_words, tokenized
    # Score this row's prompt tokens (top-k alternatives): set for one sequence per request.
    prompt_logprobs: int | None = None
    # An embedding request: its prompt's hidden states are pooled (aieng.worker.embedding_pooler).
    pooling: PoolingParams | None = None


@dataclass
class RunnerStep:
    """One step for the runner: the core's plan (anything that meets the plan contract,
    `aieng.worker.step_plan.StepPlan`), plus the sampling rows that changed."""

    plan: StepPlan
    added: list[NewSamplingRow] = field(default_factory=list)
    finished_slots: list[int] = field(default_factory=list)  # applied before `added`


@dataclass
class SampledLogprobs:
    """Logprobs of the sampled rows that asked for them (`SamplingParams.logprobs` set)."""

    rows: np.ndarray  # (L,) int64: which tokens these are (indices into the sampled tokens)
    chosen: np.ndarray  # (L,) float32: log-probability of each row's sampled token
    top_ids: np.ndarray  # (L, K) int64: K = the largest `logprobs` asked for in the step
    top_logprobs: np.ndarray  # (L, K) float32; row i is valid up to num_top[i]
    num_top: np.ndarray  # (L,) int32

    @classmethod
    def empty(cls) -> SampledLogprobs:
        return cls(
            rows=np.zeros(0, np.int64),
            chosen=np.zeros(0, np.float32),
            top_ids=np.zeros((0, 0), np.int64),
            top_logprobs=np.zeros((0, 0), np.float32),
            num_top=np.zeros(0, np.int32),
        )


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens computed this step, for the rows that asked for them.

    Entry i scores the prompt token at position `positions[i] + 1` of the request in slot
    `slots[i]` (the logits at `positions[i]` predict it)."""

    slots: np.ndarray  # (P,) int64
    positions: np.ndarray  # (P,) int64
    chosen: np.ndarray  # (P,) float32: log-probability of the actual prompt token
    top_ids: np.ndarray  # (P, K) int64: K = the largest prompt_logprobs asked for in the step
    top_logprobs: np.ndarray  # (P, K) float32; entry i is valid up to num_top[i]
    num_top: np.ndarray  # (P,) int32


@dataclass
class PooledEmbeddings:
    """The embeddings finished this step: row i is the pooled prompt of slot `slots[i]`."""

    slots: np.ndarray  # (E,) int64
    vectors: np.ndarray  # (E, hidden) float32


@dataclass
class ModelRunnerOutput:
    """Tokens accepted this step, sampling request after sampling request (the distinct rows
    of the plan's `sample_request_rows`, in order).

    Request g owns `sampled_token_ids[offsets[g]:offsets[g] + num_sampled[g]]`: one token, or
    with speculative decoding its accepted drafts and one more."""

    sampled_token_ids: np.ndarray  # (N,) int64
    num_sampled: np.ndarray  # (G,) int32
    logprobs: SampledLogprobs  # its rows index sampled_token_ids
    prompt_logprobs: PromptLogprobs | None = None
    # Slots whose own sampling state or sampling failed this step, with the cause: only their
    # requests end (finish reason "error"); a sampled row of theirs holds token -1.
    failed_slots: dict[int, str] = field(default_factory=dict)
    pooled: PooledEmbeddings | None = None  # embedding requests whose prompt is complete
    # draft_model speculation: the draft model's proposals for the next step, by slot.
    drafts: dict[int, list[int]] | None = None

    @classmethod
    def empty(
        cls,
        prompt_logprobs: PromptLogprobs | None = None,
        failed_slots: dict[int, str] | None = None,
        pooled: PooledEmbeddings | None = None,
    ) -> ModelRunnerOutput:
        return cls(
            np.zeros(0, np.int64),
            np.zeros(0, np.int32),
            SampledLogprobs.empty(),
            prompt_logprobs,
            failed_slots or {},
            pooled,
        )
