"""When a request passed each stage on its way to its first output, for the request log.

`mark(scope, name)` notes time.monotonic() under `name` in the request's ASGI state (first
mark wins); `stage_times(state)` gives each stage's seconds since the one before it, from the
arrival that RequestIdMiddleware notes. The request log shows them at debug level (`stages=`):
a slow first token is then found in its stage (body read, parse, tokenize, fair gate, engine)
rather than guessed.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from typing import Any


def mark(scope: MutableMapping[str, Any], name: str, at: float | None = None) -> None:
    """Notes `at` (default: now, time.monotonic()) as the time the request passed `name`."""
    stages = scope.setdefault("state", {}).setdefault("stages", {})
    stages.setdefault(name, time.monotonic() if at is None else at)


def stage_times(state: MutableMapping[str, Any]) -> str | None:
    """`name:seconds,...` in order of time, each from the stage before (the first from the
    arrival); None without marks."""
    stages = state.get("stages")
    arrival = state.get("arrival")
    if not stages or arrival is None:
        return None
    parts, before = [], arrival
    for name, at in sorted(stages.items(), key=lambda item: item[1]):
        parts.append(f"{name}:{at - before:.6f}")
        before = at
    return ",".join(parts)
