"""Which engine replica serves a request, and what every replica last reported.

`EngineReplicaRouter` is a Ray Serve `RequestRouter`: Ray calls it in the process that holds
the deployment handle (the ingress), with the replicas that run. Two policies:

- `prefix`: a request goes to the replica that served the longest chain of its leading KV
  blocks before (the hash of the first `prefix_blocks` full blocks of its token ids), where
  those blocks likely still sit in the replica's prefix cache — unless that replica holds
  `imbalance` more requests than the least loaded one; then, and for a prefix never seen, the
  least loaded replica takes it and becomes the prefix's owner.
- `round_robin`: the replicas in turn (the baseline the prefix policy is measured against).

Either way a replica whose queue is full (`max_ongoing_requests`) is passed over for the next
one in the ranking (Ray probes the queue lengths), and a replica the ingress drains (a rolling
upgrade) gets no new request while another can take it. A call whose `replica` keyword names
one replica goes to that one only. The replicas' own figures (their `EngineStats` and model
version, sent by `record_routing_stats`) are kept on a `ReplicaBoard` that the ingress reads
for its metrics.

Ray ships this module to the router by value (`RequestRouterConfig`), so it holds no state of
its own: what the ingress shares with the router lives in `aieng.ray.board`.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from aieng.engine.engine_client import EngineStats
from aieng.ray.board import STATS_KEY, VERSION_KEY, ReplicaBoard, ReplicaReport

MAX_REMEMBERED_PREFIXES = 1 << 16  # prefix hashes kept (LRU); each names one replica
TARGET_KEY = "replica"  # a call's keyword naming the one replica it is for


def prefix_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
    """The chained hashes of the prompt's first full blocks: entry i covers blocks 0..i (the
    engine caches only full blocks, and a block is reusable only after the same prefix)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class EngineReplicaRouter(RequestRouter):
    """Routes `EngineReplica.generate` calls (their `prompt` keyword) by the policy above."""

    def initialize_state(
        self,
        policy: str = "prefix",
        block_size: int = 16,
        prefix_blocks: int = 4,
        imbalance: int = 8,
        board: str = "",
        **_: Any,
    ) -> None:
        self.policy, self.block_size = policy, block_size
        self.prefix_blocks, self.imbalance = prefix_blocks, imbalance
        self.board = ReplicaBoard.of(board) if board else None
        self.owners: OrderedDict[int, ReplicaID] = OrderedDict()
        self.owned: Counter[ReplicaID] = Counter()  # prefix hashes each replica owns
        self.in_flight: dict[ReplicaID, int] = {}
        self.turn = itertools.count()

    # ------------------------------------------------------------------ choosing

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        target = pending_request.kwargs.get(TARGET_KEY) if pending_request is not None else None
        if target is not None:  # a call for one replica (a rolling upgrade's reload)
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            return [chosen] if chosen else []
        draining = self.board.draining() if self.board is not None else frozenset()
        serving = [r for r in candidate_replicas if r.replica_id.unique_id not in draining]
        candidate_replicas = serving or candidate_replicas  # draining ones only: they queue it
        if not candidate_replicas:
            return []
        if self.policy == "round_robin":
            start = next(self.turn) % len(candidate_replicas)
            order = candidate_replicas[start:] + candidate_replicas[:start]
            return [[r] for r in order]
        by_load = sorted(candidate_replicas, key=self._load)
        owner = self._owner(pending_request, candidate_replicas)
        if owner is not None and self._excess(owner, by_load[0]) < self.imbalance:
            return [[owner]] + [[r] for r in by_load if r.replica_id != owner.replica_id]
        return [[r] for r in by_load]

    def _load(self, replica: RunningReplica) -> tuple[int, int]:
        """Requests in flight, then prefixes owned: new prefixes spread evenly."""
        return self.in_flight.get(replica.replica_id, 0), self.owned[replica.replica_id]

    def _excess(self, replica: RunningReplica, least_loaded: RunningReplica) -> int:
        return self._load(replica)[0] - self._load(least_loaded)[0]

    def _owner(
        self, pending: PendingRequest | None, candidates: list[RunningReplica]
    ) -> RunningReplica | None:
        """The candidate that served the longest known prefix of the request's prompt."""
        hashes = self._hashes(pending)
        by_id = {r.replica_id: r for r in candidates}
        for key in reversed(hashes):
            replica_id = self.owners.get(key)
            if replica_id is not None and replica_id in by_id:
                return by_id[replica_id]
        return None

    def _hashes(self, pending: PendingRequest | None) -> list[int]:
        if pending is None or self.policy != "prefix":
            return []
        prompt = pending.kwargs.get("prompt") or ()
        return prefix_hashes(prompt, self.block_size, self.prefix_blocks)

    # ------------------------------------------------------------------ bookkeeping

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        for key in self._hashes(pending_request):
            previous = self.owners.get(key)
            if previous != replica_id:
                if previous is not None:
                    self.owned[previous] -= 1
                self.owned[replica_id] += 1
            self.owners[key] = replica_id
            self.owners.move_to_end(key)
        while len(self.owners) > MAX_REMEMBERED_PREFIXES:
            self.owned[self.owners.popitem(last=False)[1]] -= 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.in_flight.get(replica_id, 0) > 0:
            self.in_flight[replica_id] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        for gone in set(self.in_flight) - alive:
            del self.in_flight[gone]
        if not alive.issuperset(self.owned):
            self.owners = OrderedDict((k, v) for k, v in self.owners.items() if v in alive)
            self.owned = Counter({r: n for r, n in self.owned.items() if r in alive})
        if self.board is not None:
            self.board.update(
                {
                    r.replica_id.unique_id: ReplicaReport(
                        EngineStats(**r.routing_stats[STATS_KEY]),
                        r.routing_stats.get(VERSION_KEY, ""),
                    )
                    for r in replicas
                    if STATS_KEY in (r.routing_stats or {})
                }
            )
