"""`MultiprocExecutor`: tensor_parallel_size N > 1 — rank 0's worker in this process, ranks
1..N-1 in processes of their own (vLLM's multiprocessing executor).

On one machine the executor spawns ranks 1..N-1 (`torch.multiprocessing`, spawn), which
rendezvous with rank 0 through env:// — the path a launcher (torchrun) takes on several machines,
where every process finds its RANK and WORLD_SIZE in the environment and ranks > 0 become
workers (`launched_place`, `run_as_launched_worker`).

Each step rank 0 broadcasts one message (`messages.Execute`) and runs its own worker; the
collectives inside the model keep the ranks in step, and rank 0's sampled tokens are the step's.
Other worker methods go to every rank as a `messages.Call` (`collective_rpc`); the minimum of the
ranks' KV-cache memory is taken there, by an all-reduce over the ranks' results.

Failures are fatal: after one the ranks are out of step. A worker that dies is seen by a
watcher thread at once (and by the collective it leaves, which raises); one that hangs makes
the next collective raise after `distributed_timeout_s`. Either way the engine learns it through
`on_failure` or a `WorkerFailedError` (a typed, fatal failure), the remaining workers are stopped
and joined, and nothing waits forever. The broadcast step and these rules are written once, for
this executor and the Ray one, in `aieng.executor.broadcast`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import EngineConfig
from aieng.executor.base import ExecutorError, WorkerFailedError
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
from aieng.executor.rank import launched_place

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["MultiprocExecutor", "check_size", "free_port", "run_as_launched_worker"]

TERM_S = 1.0  # how long a worker gets after SIGTERM before SIGKILL (a stopped one never exits)
REPORT_WAIT_S = 2.0  # after a collective fails: how long to wait for the worker's exit


def run_as_launched_worker(args: EngineArgs) -> int | None:
    """For commands that do more than build an engine (`aieng serve`): in a launcher's rank
    > 0, serve as a worker and return the exit status; elsewhere None."""
    if args.tensor_parallel_size == 1:
        return None
    place = launched_place(args.tensor_parallel_size)
    if place is None or place.rank == 0:
        return None
    from aieng.config.engine_config import create_engine_config
    from aieng.executor.worker_process import run_launched

    return run_launched(create_engine_config(args), place)


def check_size(config: EngineConfig) -> None:
    """Refuses a size the machine cannot hold: more ranks than CUDA devices. More ranks than
    CPU cores only warns: it runs, each rank on one thread, slower."""
    size = config.parallel.tensor_parallel_size
    if config.uses_cuda:
        import torch

        count = torch.cuda.device_count()
        if size > count:
            raise ValueError(
                f"tensor_parallel_size {size} needs {size} CUDA devices, this machine has {count}"
            )
    elif size > (os.cpu_count() or 1):
        logger.warning(
            "tensor_parallel_size %d exceeds the %d CPU cores: the ranks share cores",
            size,
            os.cpu_count() or 1,
        )


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class _Workers(Ranks):
    """The spawned ranks 1..N-1: their processes, start-up reports and the watcher thread."""

    def __init__(self) -> None:
        super().__init__()
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.errors: dict[int, str] = {}
        self._stop_send: Connection | None = None

    def spawn(self, config: EngineConfig, world: int, addr: str, port: int) -> None:
        import torch.multiprocessing as mp

        from aieng.executor.worker_process import run_spawned
        from aieng.worker.device import RankPlace

        ctx = mp.get_context("spawn")
        for rank in range(1, world):
            recv, send = ctx.Pipe(duplex=False)
            place = RankPlace(rank, world, rank)
            proc = ctx.Process(
                target=run_spawned,
                args=(config, place, addr, port, send),
                name=f"aieng-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            send.close()
            self.procs.append(proc)
            self.conns.append(recv)

    def reason(self, index: int) -> str:
        """What happened to worker `index` (rank index + 1), with its own error if it sent one."""
        proc = self.procs[index]
        self.collect_reports()
        error = self.errors.get(index)
        text = f"worker rank {index + 1} (pid {proc.pid}) {describe_exit(proc.exitcode)}"
        return f"{text}: {error}" if error else text

    def collect_reports(self) -> None:
        for index, conn in enumerate(self.conns):
            try:
                while conn.poll():
                    kind, text = conn.recv()
                    if kind == "error":
                        self.errors[index] = text
            except (EOFError, OSError):
                continue

    def wait_for(self, kind: str, timeout_s: float, limit: str) -> None:
        """Until every worker reported `kind` ("started": imports done, about to join;
        "ready": its runner built); one that failed or died raises its error."""
        deadline = time.monotonic() + timeout_s
        pending = set(range(len(self.procs)))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerFailedError(
                    f"{FAILURE}: worker rank {min(pending) + 1} not {kind} within {limit}"
                )
            objects = [self.conns[i] for i in pending] + [self.procs[i].sentinel for i in pending]
            for ready in wait(objects, timeout=min(remaining, 0.5)):
                for index in list(pending):
                    proc, conn = self.procs[index], self.conns[index]
                    if ready is conn:
                        try:
                            got, text = conn.recv()
                        except EOFError:  # it exited without a word: its sentinel says how
                            proc.join()
                            raise self.start_error(index, before=kind) from None
                        if got == kind:
                            pending.discard(index)
                        elif got == "error":
                            self.errors[index] = text
                            proc.join(REPORT_WAIT_S)
                            raise self.start_error(index)
                    elif ready == proc.sentinel:
                        proc.join()
                        raise self.start_error(index, before=kind)

    def start_error(self, index: int, before: str = "") -> Exception:
        """A worker's start-up failure as the driver's one line: its own exception's type when
        that is a plain input error (ValueError), else a WorkerFailedError."""
        self.collect_reports()
        error = self.errors.get(index, "")
        name, _, text = error.partition(": ")
        if name == "ValueError":
            return ValueError(text)
        message = f"{FAILURE} at start-up: {self.reason(index)}"
        if not error and before == "started":  # it died importing the spawning script
            message += (
                " before it could start; a script that starts a tensor-parallel engine must "
                "guard its top level with `if __name__ == '__main__':` (spawned ranks import it)"
            )
        return WorkerFailedError(message)

    def watch(self) -> None:
        import multiprocessing as mp

        stop, self._stop_send = mp.Pipe(duplex=False)
        threading.Thread(
            target=self._watch, args=(stop,), name="aieng-tp-watcher", daemon=True
        ).start()

    def _watch(self, stop: Connection) -> None:
        sentinels = {proc.sentinel: i for i, proc in enumerate(self.procs)}
        ready = wait([*sentinels, stop])
        if self.closing or self.failure is not None or stop in ready:
            return  # shut down, or stopped by `fail` after a failed step
        index = next(sentinels[s] for s in ready if s in sentinels)
        self.procs[index].join()
        reason = f"{FAILURE}: {self.reason(index)}"
        logger.error("%s", reason)
        self.fail(reason)

    def stop(self) -> None:
        """Every worker that is still running is terminated, killed if it must be, joined."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(TERM_S)
            if proc.is_alive():  # stopped (SIGSTOP) or ignoring SIGTERM
                proc.kill()
                proc.join()

    def join(self, timeout_s: float) -> None:
        for proc in self.procs:
            proc.join(timeout_s)

    def stop_watching(self) -> None:
        if self._stop_send is not None:
            try:
                self._stop_send.send(None)
            except OSError:  # the watcher already returned, closing its end
                pass


class MultiprocExecutor(BroadcastExecutor):
    """Rank 0 of a tensor-parallel group: its worker in this process, and every call first
    broadcast to the other ranks."""

    def __init__(
        self,
        config: EngineConfig,
        on_failure: Callable[[str], None] | None = None,
        launched: bool = False,
    ):
        """on_failure(reason): called from a watcher thread when a worker dies between steps
        (held weakly, so the executor never keeps its engine alive). launched: a launcher
        started the ranks; else this spawns ranks 1..N-1."""
        from aieng.worker.device import RankPlace
        from aieng.worker.worker import Worker

        check_size(config)
        self.config = config
        threads_before = self._take_threads(config)
        self._ranks = _Workers()
        self._ranks.on_failure = weak_callback(on_failure)
        self.driver = Worker(config, RankPlace(0, self.world_size, 0), samples=True)
        try:
            self._group = self._join() if launched else self._start_workers(config)
            self.driver.load_model()
            if not launched:
                timeout = config.parallel.distributed_timeout_s
                self._ranks.wait_for("ready", timeout, f"distributed_timeout_s ({timeout:g} s)")
        except BaseException as error:
            abandon_start(self._ranks, threads_before)
            raised = start_failure(error, config, self._first_worker_error())
            if raised is error:
                raise
            raise raised from error
        if not launched:
            self._ranks.watch()
        self._started(threads_before)
        logger.info("tensor parallelism: %d ranks, this process is rank 0", self.world_size)

    def _join(self) -> dist.ProcessGroup:
        """Rank 0's worker selects its device and joins the group: the group of step messages."""
        group = self.driver.init_device()
        assert group is not None  # rank 0 of a group
        return group

    def _start_workers(self, config: EngineConfig) -> dist.ProcessGroup:
        """Spawns ranks 1..N-1 on this machine and joins them (env:// on MASTER_ADDR, a free
        MASTER_PORT unless MASTER_PORT is given)."""
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT") or free_port(addr))
        _check_port_free(addr, port)
        self._ranks.spawn(config, self.world_size, addr, port)
        # Each worker first imports torch and aieng (seconds); the rendezvous, bounded by
        # distributed_timeout_s, starts once they all can join it.
        self._ranks.wait_for("started", START_S, f"{START_S:g} s")
        with master_env(addr, port):
            return self._join()

    def _first_worker_error(self) -> Exception | None:
        self._ranks.collect_reports()
        for index in range(len(self._ranks.procs)):
            if self._ranks.errors.get(index):
                return self._ranks.start_error(index)
        return None

    # ------------------------------------------------------------------ the executor

    def _fail(self, error: Exception) -> WorkerFailedError:
        """The step raised: a worker died (its connection closed: wait a moment for its exit to
        say how), hung (the collective timed out) or this rank failed."""
        text = f"{type(error).__name__}: {error}"
        closed = "Connection closed" in text or "Connection reset" in text
        deadline = time.monotonic() + (REPORT_WAIT_S if closed else 0.0)
        while self._ranks.failure is None:
            dead = [i for i, p in enumerate(self._ranks.procs) if p.exitcode is not None]
            if dead:
                self._ranks.fail(f"{FAILURE}: {self._ranks.reason(dead[0])}")
            elif time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            break
        if self._ranks.failure is None:
            if closed:
                cause = "a rank's connection closed: it died or left"
            else:
                limit = self.config.parallel.distributed_timeout_s
                cause = f"a rank hung past distributed_timeout_s = {limit:g} s, or this one failed"
            self._ranks.fail(f"{FAILURE}: {text} ({cause})")
        return WorkerFailedError(self._ranks.failure)

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the ranks this process spawned (none when a launcher did)."""
        return [proc.pid for proc in self._ranks.procs]


def _check_port_free(addr: str, port: int) -> None:
    """The rendezvous port must be free on this machine: say so in one line, before spawning."""
    with socket.socket() as sock:
        try:
            sock.bind((addr, port))
        except OSError as error:
            raise ExecutorError(
                f"tensor-parallel rendezvous port {addr}:{port} (MASTER_ADDR:MASTER_PORT) cannot "
                f"be used: {error.strerror or error}"
            ) from None
