"""Small requests before large bodies on the event loop (issue 37).

The event loop reads every request body, chunk by chunk (uvicorn's h11: each chunk copied
several times, GIL held). A flood of 4 MB bodies, eight at a time, kept it busy half a core,
and its sender busy another quarter, on a two-core machine: each turn of the loop that a light
chat request needs on its way to its first token (its handler, tokenized, through the gate,
its first output delivered, its first chunk sent: five turns or more) came late behind the
flood's chunks, and the engine's thread waited for a core behind the loop and the flood's
client. That, not the engine's step, was most of a light request's time to first token under
the flood (`benches/results/fair_load_breakdown.md`).

So while a small request (a body of at most `SMALL_BODY_BYTES`, or none) is on its way to its
first answer, large bodies wait before each chunk they read: the loop does not read them, so
their connections stay paused (uvicorn stops reading a connection once 64 KiB of its body wait
unread) and their senders block on full sockets. A small request holds large bodies back until
its first response bytes are sent, for at most `hold_s`; and a large body waits at most `hold_s`
per chunk however many small requests follow one another, so small requests slow large bodies
down but never stop them. Nothing is refused here; `hold_s` 0 turns it off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# A body up to this size is small: read in a chunk or two, parsed on the loop (the size past
# which offloop parses in a thread, and at which uvicorn pauses reading a connection).
SMALL_BODY_BYTES = 64 * 1024


def _released() -> None:
    pass


class SmallFirst:
    """Counts the small requests not yet answered; large bodies' chunks wait for none."""

    def __init__(self, hold_s: float):
        if hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {hold_s}")
        self.hold_s = hold_s
        self.holding = 0  # small requests holding large bodies back (one event loop: no lock)
        self._none = asyncio.Event()
        self._none.set()

    def hold(self) -> Callable[[], None]:
        """A small request starts: large bodies wait until its release (call it once its first
        answer is sent; more calls do nothing), or for `hold_s` at most."""
        if self.hold_s <= 0:
            return _released
        self.holding += 1
        self._none.clear()
        timer: asyncio.TimerHandle | None = None

        def release() -> None:
            nonlocal timer
            if timer is None:
                return
            timer.cancel()
            timer = None
            self.holding -= 1
            if not self.holding:
                self._none.set()

        timer = asyncio.get_running_loop().call_later(self.hold_s, release)
        return release

    async def turn(self) -> None:
        """Before a large body's next chunk: waits while small requests hold, `hold_s` at most."""
        if not self.holding:
            return
        try:
            await asyncio.wait_for(self._none.wait(), self.hold_s)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            pass
