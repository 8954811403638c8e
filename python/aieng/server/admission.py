"""Admission control: refuse at once what the server cannot start soon, never queue unboundedly.

A request is queued from admission until its first output arrives; the queue is bounded by
requests and by prompt tokens, and no request is admitted while the KV cache is past its
watermark. Everything runs on the event loop, so the counts are exact at decision time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from aieng.engine.engine_client import EngineStats
from aieng.server.config import ServerConfig

RETRY_AFTER_S = 1


class ServerState(str, Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str  # the label of aieng_request_rejected_total
    message: str
    retry_after: int | None = RETRY_AFTER_S

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


class Admission:
    def __init__(self, config: ServerConfig, stats: Callable[[], EngineStats | None]):
        self.config = config
        self.stats = stats
        self.state = ServerState.STARTING
        self._queued: dict[str, int] = {}  # request id -> prompt tokens
        self._in_flight: set[str] = set()
        self.queued_tokens = 0

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def refusal(self, prompt_tokens: list[int]) -> Refusal | None:
        """Why a request of these prompts (one per engine request) cannot be admitted now."""
        if self.state is ServerState.STARTING:
            return Refusal(503, "starting", "the server is starting; retry shortly", 5)
        if self.state is ServerState.DRAINING:
            return Refusal(503, "draining", "the server is shutting down", None)
        never = self._never_admitted(prompt_tokens)
        if never is not None:
            return never
        limit = self.config.max_queue_requests
        if self.num_queued + len(prompt_tokens) > limit:
            return Refusal(
                429, "queue_requests", f"the waiting queue is full ({limit} requests); retry later"
            )
        limit = self.config.max_queue_tokens
        if self.queued_tokens + sum(prompt_tokens) > limit:
            return Refusal(
                429,
                "queue_tokens",
                f"the waiting queue holds {self.queued_tokens} of at most {limit} prompt "
                f"tokens and this request adds {sum(prompt_tokens)}; retry later",
            )
        stats = self.stats()
        watermark = self.config.kv_cache_watermark
        if stats is not None and stats.kv_cache_usage >= watermark and self.num_queued:
            return Refusal(
                429,
                "kv_cache",
                f"the KV cache is {stats.kv_cache_usage:.0%} full (watermark {watermark:.0%}) "
                "with requests already waiting; retry later",
            )
        return None

    def _never_admitted(self, prompt_tokens: list[int]) -> Refusal | None:
        """A request past the queue limits on its own: retrying cannot help, so 400."""
        if len(prompt_tokens) > self.config.max_queue_requests:
            return Refusal(
                400,
                "exceeds_queue_limits",
                f"{len(prompt_tokens)} prompts in one request, but the server queues at most "
                f"{self.config.max_queue_requests} requests",
                None,
            )
        if sum(prompt_tokens) > self.config.max_queue_tokens:
            return Refusal(
                400,
                "exceeds_queue_limits",
                f"the prompts have {sum(prompt_tokens)} tokens, but the server queues at most "
                f"{self.config.max_queue_tokens} prompt tokens",
                None,
            )
        return None

    def admit(self, request_id: str, prompt_tokens: int) -> None:
        self._queued[request_id] = prompt_tokens
        self.queued_tokens += prompt_tokens
        self._in_flight.add(request_id)

    def started(self, request_id: str) -> None:
        self.queued_tokens -= self._queued.pop(request_id, 0)

    def done(self, request_id: str) -> None:
        self.started(request_id)
        self._in_flight.discard(request_id)
