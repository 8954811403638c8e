"""A tensor-parallel worker: ranks 1..N-1, each a process holding its rank's runner.

The worker joins the group, builds its runner, then runs whatever rank 0 broadcasts — one
`Execute` per engine step, a `Call` for other forwards — until a `Shutdown` or until the group
breaks (a dead driver closes its connections). Its sampled tokens are never needed: the driver
samples.

Started two ways: spawned by the driver on one machine (`run_spawned`, which reports start-up
failures to the driver through a pipe), or by a launcher such as torchrun on every machine
(`run_launched`; RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from the environment).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import EngineConfig

if TYPE_CHECKING:
    import torch.distributed as dist

    from aieng.worker.device import RankPlace
    from aieng.worker.worker import Worker

logger = logging.getLogger(__name__)


def serve_steps(worker: Worker, group: dist.ProcessGroup) -> None:
    """Runs rank 0's messages on `worker` until Shutdown; a broken group raises."""
    from aieng.executor.messages import Call, Execute, Shutdown, receive_message, run_call

    while True:
        message = receive_message(group)
        if isinstance(message, Shutdown):
            return
        if isinstance(message, Execute):
            worker.execute(message.step)
        elif isinstance(message, Call):
            run_call(worker, message)
        else:
            raise TypeError(f"unknown tensor-parallel message {type(message).__name__}")


def run_worker(
    config: EngineConfig,
    place: RankPlace,
    report: Callable[[str, str], None] | None = None,
) -> None:
    """Join, build this rank's runner, serve steps, leave. `report(kind, text)`: tells the
    driver the worker has started and is ready (its caller reports failures)."""
    import torch

    from aieng.distributed import parallel_state
    from aieng.worker.device import cpu_threads
    from aieng.worker.worker import Worker

    threads = cpu_threads(config, place.world_size)
    if threads is not None:
        torch.set_num_threads(threads)
        logger.info("tensor-parallel rank %d: %d CPU threads", place.rank, threads)
    if report is not None:
        report("started", "")
    worker = Worker(config, place, samples=False)
    group = worker.init_device()
    assert group is not None  # a rank of a group
    try:
        worker.load_model()
        if report is not None:
            report("ready", "")
        serve_steps(worker, group)
    finally:
        parallel_state.destroy_tensor_parallel()


def run_spawned(
    config: EngineConfig,
    place: RankPlace,
    master_addr: str,
    master_port: int,
    conn: Connection,
) -> None:
    """The target of a process the driver spawned on this machine. Ctrl-C in the terminal
    reaches the whole process group: the driver decides what it means, not its workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(place.rank),
        WORLD_SIZE=str(place.world_size),
        LOCAL_RANK=str(place.local_rank),
    )

    def report(kind: str, text: str) -> None:
        try:
            conn.send((kind, text))
        except OSError:  # the driver is gone
            pass

    try:
        run_worker(config, place, report)
    except BaseException as error:
        if not isinstance(error, KeyboardInterrupt):
            report("error", f"{type(error).__name__}: {error}")
            traceback.print_exc()
        sys.exit(1)


def run_launched(config: EngineConfig, place: RankPlace) -> int:
    """A rank > 0 started by a launcher (torchrun): serve until rank 0 shuts down; the exit
    status, 0 after a clean shutdown, 1 after a failure (logged)."""
    try:
        run_worker(config, place)
    except Exception as error:
        logger.error(
            "tensor-parallel rank %d failed: %s: %s", place.rank, type(error).__name__, error
        )
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m aieng.executor.worker_process [engine options]` on a machine whose processes a
    launcher started: rank 0 serves as `aieng serve` does, the others run here."""
    import argparse

    from aieng.executor.rank import launched_place

    parser = argparse.ArgumentParser(prog="python -m aieng.executor.worker_process")
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(argv))
    place = launched_place(args.tensor_parallel_size)
    if place is None or place.rank == 0:
        parser.error("run by a launcher as a rank > 0 (RANK and WORLD_SIZE in the environment)")
    from aieng.config.engine_config import create_engine_config

    return run_launched(create_engine_config(args), place)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main())
