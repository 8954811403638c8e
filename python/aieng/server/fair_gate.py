"""The door between admitted requests and an engine: they go in by fair shares, not by arrival.

The engine shares each step's prefill budget between the clients of the requests it holds,
but it can hold only so many (`max_num_seqs` running): two embedding requests of 128 inputs
each, all handed over at once, would fill its slots and hold a chat turn from another client
behind 256 prefills. Here the engine is kept just full enough to fill its next steps — at most
`max_requests` of its requests, or `max_tokens` prompt tokens, not yet started (no output yet)
— and the others wait at this gate in a `FairQueue` by (kind, address, key): generation and
embeddings share equally when both wait, then the clients within each kind, in prompt tokens.
A flow (kind, address, key) with nothing in the engine and nothing waiting puts its request
in at once, past the bounds: the gate's room is shared too, so a light client never waits for
a heavy client's requests to start (that wait was a step or two of its first token); the
engine's own fair share then gives it its part of the next step. The bounds are passed by at
most one request per flow, and the flows are bounded by the admission queue. Priority classes
still apply on top, in the engine's scheduler.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field

from aieng.server.fair_queue import FairQueue


@dataclass(eq=False)
class _Ticket:
    engine_id: str
    tokens: int
    path: tuple[Hashable, ...]
    entered: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class FairGate:
    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self._waiting: FairQueue[_Ticket] = FairQueue(depth=3)
        # engine id -> (prompt tokens, flow), in and not started
        self._inside: dict[str, tuple[int, tuple[Hashable, ...]]] = {}
        self._inside_tokens = 0
        self._inside_by_flow: Counter[tuple[Hashable, ...]] = Counter()
        self._waiting_by_flow: Counter[tuple[Hashable, ...]] = Counter()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        return not self._inside and not len(self._waiting)

    def try_enter(self, path: tuple[Hashable, ...], engine_id: str, tokens: int) -> bool:
        """Lets the request in now if it may go without waiting (a newcomer flow, or room and
        nobody waiting); `started(engine_id)` must follow. In the caller's turn of the loop:
        a light request goes on to the engine without waiting for another one."""
        newcomer = not self._inside_by_flow[path] and not self._waiting_by_flow[path]
        if newcomer or (self._has_room() and not len(self._waiting)):
            self._let_in(engine_id, tokens, path)
            return True
        return False

    async def enter(
        self, path: tuple[Hashable, Hashable, Hashable], engine_id: str, tokens: int
    ) -> None:
        """Returns once the request may go to the engine; `started(engine_id)` must follow
        (when its first output comes, or when it ends). Cancelled: it leaves the queue."""
        if self.try_enter(path, engine_id, tokens):
            return
        ticket = _Ticket(engine_id, tokens, path)
        self._waiting.push(path, ticket, tokens + 1)  # +1: no request is free
        self._waiting_by_flow[path] += 1
        try:
            await ticket.entered
        except BaseException:
            if self._waiting.remove(path, ticket):
                self._left_queue(path)
            else:
                self.started(engine_id)  # let in as it was cancelled: its place is free again
            raise

    def started(self, engine_id: str) -> None:
        inside = self._inside.pop(engine_id, None)
        if inside is None:
            return
        tokens, path = inside
        self._inside_tokens -= tokens
        _drop(self._inside_by_flow, path)
        self._let_waiting_in()

    def abort_waiting(self, error: BaseException) -> None:
        """Every waiting request gets `error` (the server is shutting down)."""
        while len(self._waiting):
            ticket = self._waiting.pop()
            self._left_queue(ticket.path)
            if not ticket.entered.done():
                ticket.entered.set_exception(error)

    def _has_room(self) -> bool:
        """Room for one more (a prompt larger than max_tokens goes in alone)."""
        return len(self._inside) < self.max_requests and self._inside_tokens < self.max_tokens

    def _let_in(self, engine_id: str, tokens: int, path: tuple[Hashable, ...]) -> None:
        self._inside[engine_id] = (tokens, path)
        self._inside_tokens += tokens
        self._inside_by_flow[path] += 1

    def _left_queue(self, path: tuple[Hashable, ...]) -> None:
        _drop(self._waiting_by_flow, path)

    def _let_waiting_in(self) -> None:
        while self._has_room() and len(self._waiting):
            ticket = self._waiting.pop()
            self._left_queue(ticket.path)
            if ticket.entered.done():  # cancelled between its wake-up and now
                continue
            self._let_in(ticket.engine_id, ticket.tokens, ticket.path)
            ticket.entered.set_result(None)


def _drop(counts: Counter, key: Hashable) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]
