"""What every replica last reported, and which replicas are draining: shared by the router
(which receives the reports and skips the draining replicas), the ingress's `ReplicaPoolClient`
(which pools the reports), its per-replica metrics and its rolling upgrade (which drains one
replica at a time) — all in the ingress's process."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import ClassVar

from aieng.engine.engine_client import EngineStats

STATS_KEY = "engine_stats"  # the key of a replica's EngineStats in its routing stats
VERSION_KEY = "model_version"  # the model version it serves ("" without a manifest)


@dataclass(frozen=True)
class ReplicaReport:
    stats: EngineStats
    version: str = ""


class ReplicaBoard:
    """The last report of every running replica of one deployment, as its router saw them
    (written in the router's event loop, read from the ingress's: hence the lock), and the
    replicas the ingress is draining."""

    _boards: ClassVar[dict[str, ReplicaBoard]] = {}
    _boards_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: dict[str, ReplicaReport] = {}
        self._draining: set[str] = set()

    @classmethod
    def of(cls, deployment: str) -> ReplicaBoard:
        """The board of the deployment named `deployment` in this process (made on first use)."""
        with cls._boards_lock:
            return cls._boards.setdefault(deployment, cls())

    def update(self, reports: dict[str, ReplicaReport]) -> None:
        with self._lock:
            self._reports = dict(reports)

    def reports(self) -> dict[str, ReplicaReport]:
        """Replica id -> its last report."""
        with self._lock:
            return dict(self._reports)

    def snapshot(self) -> dict[str, EngineStats]:
        """Replica id -> its last EngineStats."""
        with self._lock:
            return {replica: report.stats for replica, report in self._reports.items()}

    def drain(self, replica: str) -> None:
        """The router sends `replica` no new request (while another replica can take it)."""
        with self._lock:
            self._draining.add(replica)

    def undrain(self, replica: str) -> None:
        with self._lock:
            self._draining.discard(replica)

    def draining(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._draining)
