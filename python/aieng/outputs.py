"""What generate() and stream() return: vLLM's RequestOutput and CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RequestMetrics:
    """Times are `time.monotonic()` seconds; derived values are None until known."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    # The request's share of the engine's step time: each step's wall time split over its
    # requests by the tokens each had scheduled in it (what the request costs to serve).
    engine_seconds: float = 0.0
    # The token budget of the step that first scheduled it: max_num_batched_tokens, less when
    # the step was bounded in time because several clients shared the engine.
    first_step_token_budget: int | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds per output token after the first."""
        if self.finished_time is None or self.first_token_time is None:
            return None
        if self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (it has
    # no context); each maps the prompt token and the top alternatives to their logprobs.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # An embedding request (PoolingParams): its pooled prompt, (hidden,) float32.
    embedding: np.ndarray | None = None


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    embedding: np.ndarray  # (dimensions,) float32

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
