"""`RayExecutor`: tensor_parallel_size N > 1 with ranks 1..N-1 as Ray actors
(`distributed_executor_backend="ray"`), so that one engine spans the nodes of a Ray cluster.

Rank 0's worker stays in the engine's process, as with the multiprocess executor; the other
ranks are `RankActor`s in a placement group of one bundle per rank (a CPU, and a GPU on CUDA;
PACK: on one node when it fits). They rendezvous with rank 0 through env:// on rank 0's node
address and a free port, then run the same worker loop as a spawned rank
(`aieng.executor.worker_process.run_worker`): torch.distributed over gloo on CPU, NCCL on GPU.

Failures are the multiprocess executor's (the rules of `aieng.executor.broadcast`): fatal,
typed (`WorkerFailedError`), and nothing is left behind. A watcher thread waits on every
actor's `serve` call, which returns only when the rank leaves: one that ends while the engine
runs (the actor died, or its loop raised) stops the group and tells the engine through
`on_failure`; a step whose collective fails finds the dead actor the same way. Every actor is
killed and the placement group removed on shutdown and on failure.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

from aieng.config.engine_config import EngineConfig
from aieng.executor.base import WorkerFailedError
from aieng.executor.broadcast import (
    FAILURE,
    START_S,
    BroadcastExecutor,
    Ranks,
    abandon_start,
    free_port,
    master_env,
    start_failure,
    weak_callback,
)

logger = logging.getLogger(__name__)

ACTOR_PREFIX = "aieng-tp-"  # the ranks' actor names: aieng-tp-<engine tag>-rank<r>


class RankActor:
    """One tensor-parallel rank > 0 (a Ray actor with two threads: `serve` blocks for the
    rank's life while `wait_ready` answers). Its imports (torch, the worker) are done when the
    actor is created, so that the rendezvous, bounded by distributed_timeout_s, starts only
    once every rank can join it at once."""

    def __init__(self) -> None:
        import aieng.executor.worker_process
        import aieng.worker.worker  # noqa: F401

        self._ready = threading.Event()

    def started(self) -> bool:
        return True

    def serve(self, config: EngineConfig, rank: int, world: int, addr: str, port: int) -> None:
        from aieng.executor.worker_process import run_worker
        from aieng.worker.device import RankPlace

        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        place = RankPlace(rank, world, 0)  # Ray shows each actor its own device as device 0

        def report(kind: str, _text: str) -> None:
            if kind == "ready":
                self._ready.set()

        run_worker(config, place, report)

    def wait_ready(self, timeout_s: float) -> bool:
        return self._ready.wait(timeout_s)


class _Actors(Ranks):
    """The ranks' actors, their placement group and the watcher."""

    def __init__(self) -> None:
        super().__init__()
        self.actors: list[Any] = []
        self.serving: list[Any] = []  # each actor's `serve` ObjectRef
        self.group: Any = None  # the placement group

    def start(self, config: EngineConfig, addr: str, port: int) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world = config.parallel.tensor_parallel_size
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if config.uses_cuda else {})}
        self.group = placement_group([bundle] * (world - 1), strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=START_S)
        if not ready:
            raise WorkerFailedError(
                f"{FAILURE} at start-up: the Ray cluster has no room for {world - 1} ranks of "
                f"{bundle} within {START_S:g} s"
            )
        actor_class = ray.remote(max_concurrency=2)(RankActor)
        tag = uuid.uuid4().hex[:8]
        for index in range(world - 1):
            actor = actor_class.options(
                name=f"{ACTOR_PREFIX}{tag}-rank{index + 1}",
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, index),
            ).remote()
            self.actors.append(actor)
            self.serving.append(actor.serve.remote(config, index + 1, world, addr, port))

    def wait_started(self, timeout_s: float) -> None:
        """Until every actor has been created (its imports done); one that died raises."""
        import ray

        calls = [actor.started.remote() for actor in self.actors]
        for rank, call in enumerate(calls, start=1):
            try:
                ray.get(call, timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise WorkerFailedError(
                    f"{FAILURE} at start-up: rank {rank}'s Ray actor not started within "
                    f"{timeout_s:g} s"
                ) from None
            except ray.exceptions.RayError as error:
                raise WorkerFailedError(
                    f"{FAILURE} at start-up: rank {rank}'s Ray actor died before it started "
                    f"({type(error).__name__})"
                ) from None

    def wait_ready(self, timeout_s: float) -> None:
        import ray

        waiting = {a.wait_ready.remote(timeout_s) for a in self.actors}
        late = WorkerFailedError(f"{FAILURE}: a rank was not ready within {timeout_s:g} s")
        while waiting:
            done, _ = ray.wait([*waiting, *self.serving], num_returns=1, timeout=timeout_s + 5)
            if not done:
                raise late
            if done[0] in self.serving:  # it ended before it was ready
                raise WorkerFailedError(f"{FAILURE} at start-up: {self.reason(done[0])}")
            if not ray.get(done[0]):
                raise late
            waiting.discard(done[0])

    def reason(self, serving: Any) -> str:
        """Why a rank's `serve` call ended: its actor died, or its loop raised."""
        import ray

        rank = self.serving.index(serving) + 1
        try:
            ray.get(serving, timeout=0)
        except ray.exceptions.RayActorError as error:
            return f"rank {rank}'s Ray actor died ({type(error).__name__})"
        except ray.exceptions.RayTaskError as error:
            return f"rank {rank} failed: {type(error.cause).__name__}: {error.cause}"
        except Exception as error:
            return f"rank {rank}: {type(error).__name__}: {error}"
        return f"rank {rank} left the group"

    def lost_rank(self) -> str | None:
        """Why a rank whose `serve` call has ended left (None: none has)."""
        ended = self.ended() if self.serving else None
        return None if ended is None else self.reason(ended)

    def ended(self) -> Any | None:
        import ray

        done, _ = ray.wait(self.serving, num_returns=1, timeout=0)
        return done[0] if done else None

    def watch(self) -> None:
        threading.Thread(target=self._watch, name="aieng-tp-ray-watcher", daemon=True).start()

    def _watch(self) -> None:
        import ray

        while not self.closing and self.failure is None:
            done, _ = ray.wait(self.serving, num_returns=1, timeout=0.5)
            if done and not self.closing and self.failure is None:
                reason = f"{FAILURE}: {self.reason(done[0])}"
                logger.error("%s", reason)
                self.fail(reason)

    def stop(self) -> None:
        """Every actor killed, the placement group removed: no rank outlives the engine."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None

    def stop_watching(self) -> None:
        pass  # the watcher polls, and stops once it sees `closing`

    def join(self, timeout_s: float) -> None:
        import ray

        if self.serving:
            ray.wait(self.serving, num_returns=len(self.serving), timeout=timeout_s)


class RayExecutor(BroadcastExecutor):
    """Rank 0 of a tensor-parallel group whose other ranks are Ray actors."""

    def __init__(self, config: EngineConfig, on_failure: Callable[[str], None] | None = None):
        import ray

        from aieng.worker.device import RankPlace
        from aieng.worker.worker import Worker

        if not ray.is_initialized():
            ray.init()  # RAY_ADDRESS's cluster, else a local one
        self.config = config
        threads_before = self._take_threads(config)
        self._ranks = _Actors()
        self._ranks.on_failure = weak_callback(on_failure)
        addr = ray.util.get_node_ip_address()
        port = free_port(addr)
        try:
            self._ranks.start(config, addr, port)
            self._ranks.wait_started(START_S)
            self.driver = Worker(config, RankPlace(0, self.world_size, 0), samples=True)
            with master_env(addr, port):
                group = self.driver.init_device()
            assert group is not None  # rank 0 of a group
            self._group = group
            self.driver.load_model()
            self._ranks.wait_ready(config.parallel.distributed_timeout_s)
        except BaseException as error:
            lost = self._ranks.lost_rank()  # before the close, which ends every rank
            abandon_start(self._ranks, threads_before)
            rank_error = (
                None if lost is None else WorkerFailedError(f"{FAILURE} at start-up: {lost}")
            )
            raised = start_failure(error, config, rank_error)
            if raised is error:
                raise
            raise raised from error
        self._ranks.watch()
        self._started(threads_before)
        logger.info("tensor parallelism on Ray: %d ranks, this process is rank 0", self.world_size)

    def _fail(self, error: Exception) -> WorkerFailedError:
        """The step raised: an actor died (its `serve` call ended), hung, or this rank failed."""
        import ray

        ended = self._ranks.ended()
        if ended is None:  # a dead actor's call can take a moment to resolve
            ray.wait(self._ranks.serving, num_returns=1, timeout=2.0)
            ended = self._ranks.ended()
        if ended is not None:
            self._ranks.fail(f"{FAILURE}: {self._ranks.reason(ended)}")
        else:
            limit = self.config.parallel.distributed_timeout_s
            self._ranks.fail(
                f"{FAILURE}: {type(error).__name__}: {error} (a rank hung past "
                f"distributed_timeout_s = {limit:g} s, or this one failed)"
            )
        return WorkerFailedError(self._ranks.failure)

    @property
    def actors(self) -> list[Any]:
        """The ranks' Ray actor handles (ranks 1..N-1)."""
        return list(self._ranks.actors)
