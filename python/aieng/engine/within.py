"""An await with a time limit that costs no extra turns of the event loop.

`asyncio.wait_for` before Python 3.12 wraps what it awaits in a task of its own: the task
starts a turn of the loop later, and its result comes back through a done callback another
turn or two later. On a loop busy with other clients' bodies each turn can take milliseconds
(issue 37): a light request paid them at the fair gate and at every engine output it waited
for. `asyncio.timeout` (3.11+) times the await inside the calling task instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

_timeout = getattr(asyncio, "timeout", None)


async def within(awaitable: Awaitable[T], seconds: float | None) -> T:
    """`await awaitable`; TimeoutError (the builtin) past `seconds` (None: no limit)."""
    if seconds is None:
        return await awaitable
    if _timeout is None:  # Python 3.10
        try:
            return await asyncio.wait_for(awaitable, seconds)
        except asyncio.TimeoutError:  # not the builtin before 3.11
            raise TimeoutError from None
    async with _timeout(seconds):
        return await awaitable
