"""The replicas' last `EngineStats`, shared by the router (which receives them) and the
ingress's `ReplicaPoolClient` (which reports them), both in the ingress's process."""

from __future__ import annotations

import threading
from typing import ClassVar

from aieng.engine_client import EngineStats

STATS_KEY = "engine_stats"  # the key of a replica's EngineStats in its routing stats


class ReplicaBoard:
    """The last `EngineStats` of every running replica of one deployment, as its router saw
    them; written in the router's event loop, read from the ingress's (hence the lock)."""

    _boards: ClassVar[dict[str, ReplicaBoard]] = {}
    _boards_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[str, EngineStats] = {}

    @classmethod
    def of(cls, deployment: str) -> ReplicaBoard:
        """The board of the deployment named `deployment` in this process (made on first use)."""
        with cls._boards_lock:
            return cls._boards.setdefault(deployment, cls())

    def update(self, stats: dict[str, EngineStats]) -> None:
        with self._lock:
            self._stats = dict(stats)

    def snapshot(self) -> dict[str, EngineStats]:
        with self._lock:
            return dict(self._stats)
