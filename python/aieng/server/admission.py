"""Admission control: refuse at once what the server cannot start soon, never queue unboundedly.

A request is queued from admission until its first output arrives; the queue is bounded by
requests and by prompt tokens, and a client with requests already waiting is not admitted
while the KV cache is past its watermark. One client's queue never blocks another's: past a
limit, a client is refused only while it holds at least its share of it (the limit over the
clients waiting, itself included), so a newcomer is admitted beside a flood, and the queue
holds at most twice its limit. Admitted requests then enter their engine through its
`FairGate`, by fair shares. Everything runs on the event loop, so the counts are exact at
decision time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from aieng.engine.engine_client import EngineClient, EngineStats
from aieng.server.config import ServerConfig
from aieng.server.fair_gate import FairGate

RETRY_AFTER_S = 1
Client = tuple[str, str]  # (address, API key hash): see clients.client_of


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
        self._queued: dict[str, tuple[int, Client]] = {}  # request id -> prompt tokens, client
        self._in_flight: set[str] = set()
        self.queued_tokens = 0
        self._client_requests: Counter[Client] = Counter()  # queued, by client
        self._client_tokens: Counter[Client] = Counter()
        self._gates: dict[int, FairGate] = {}  # by id(engine)
        self._gate_of: dict[str, FairGate] = {}  # request id -> the gate it entered by

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def refusal(self, prompt_tokens: list[int], client: Client = ("", "")) -> Refusal | None:
        """Why a request of these prompts (one per engine request) from `client` cannot be
        admitted now."""
        if self.state is ServerState.STARTING:
            return Refusal(503, "starting", "the server is starting; retry shortly", 5)
        if self.state is ServerState.DRAINING:
            return Refusal(503, "draining", "the server is shutting down", None)
        never = self._never_admitted(prompt_tokens)
        if never is not None:
            return never
        clients = len(self._client_requests) + (client not in self._client_requests)
        limit = self.config.max_queue_requests
        if self._over(self.num_queued, self._client_requests[client], len(prompt_tokens), limit):
            return Refusal(
                429,
                "queue_requests",
                f"the waiting queue is full ({limit} requests) and this client holds "
                f"{self._client_requests[client]} of them, its share or more ({clients} "
                "clients wait); retry later",
            )
        limit, adds = self.config.max_queue_tokens, sum(prompt_tokens)
        if self._over(self.queued_tokens, self._client_tokens[client], adds, limit):
            return Refusal(
                429,
                "queue_tokens",
                f"the waiting queue holds {self.queued_tokens} of at most {limit} prompt "
                f"tokens, {self._client_tokens[client]} of them this client's ({clients} "
                f"clients wait), and this request adds {adds}; retry later",
            )
        stats = self.stats()
        watermark = self.config.kv_cache_watermark
        if (
            stats is not None
            and stats.kv_cache_usage >= watermark
            and client in self._client_requests
        ):
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

    def _over(self, total: int, own: int, adds: int, limit: int) -> bool:
        """Past the limit, and this client holds its share (or the queue twice its limit)."""
        if total + adds <= limit:
            return False
        clients = max(1, len(self._client_requests))
        share = limit // (clients + (own == 0))
        return own + adds > share or total + adds > 2 * limit

    def admit(self, request_id: str, prompt_tokens: int, client: Client = ("", "")) -> None:
        self._queued[request_id] = (prompt_tokens, client)
        self.queued_tokens += prompt_tokens
        self._client_requests[client] += 1
        self._client_tokens[client] += prompt_tokens
        self._in_flight.add(request_id)

    def try_enter(
        self, engine: EngineClient, request_id: str, kind: str, client: Client, tokens: int
    ) -> bool:
        """Lets the request go to `engine` now if it need not wait its turn (see FairGate);
        else `enter` waits for it."""
        return self._gate(engine, request_id).try_enter((kind, *client), request_id, tokens)

    async def enter(
        self, engine: EngineClient, request_id: str, kind: str, client: Client, tokens: int
    ) -> None:
        """Waits for the request's fair turn to go to `engine` (see FairGate)."""
        await self._gate(engine, request_id).enter((kind, *client), request_id, tokens)

    def _gate(self, engine: EngineClient, request_id: str) -> FairGate:
        gate = self._gates.get(id(engine))
        if gate is None:
            info = engine.model_info
            budget = info.max_num_batched_tokens or info.max_model_len
            gate = self._gates[id(engine)] = FairGate(info.max_num_seqs, 2 * budget)
        self._gate_of[request_id] = gate
        return gate

    @property
    def num_at_gates(self) -> int:
        """Admitted requests waiting for their turn to go to an engine."""
        return sum(gate.num_waiting for gate in self._gates.values())

    def abort_waiting(self, error: BaseException) -> None:
        for gate in self._gates.values():
            gate.abort_waiting(error)

    def started(self, request_id: str) -> None:
        queued = self._queued.pop(request_id, None)
        if queued is not None:
            tokens, client = queued
            self.queued_tokens -= tokens
            self._client_tokens[client] -= tokens
            self._client_requests[client] -= 1
            if not self._client_requests[client]:
                del self._client_requests[client], self._client_tokens[client]
        gate = self._gate_of.pop(request_id, None)
        if gate is not None:
            gate.started(request_id)
            if gate.idle:  # an engine switched out leaves no gate behind
                self._gates = {k: g for k, g in self._gates.items() if g is not gate}

    def done(self, request_id: str) -> None:
        self.started(request_id)
        self._in_flight.discard(request_id)
