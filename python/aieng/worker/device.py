"""A rank's device: where the rank sits in its tensor-parallel group (`RankPlace`), its CPU
threads, and joining the group on its device — the same on the driver and on every worker."""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch.distributed as dist

from aieng.config.engine_config import EngineConfig
from aieng.distributed import parallel_state

# Workers wait for the next step message as long as the engine stays idle; a dead driver still
# ends the wait at once (its connection closes).
WORKER_IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where one rank sits: its rank, the group's size, its device index on its machine."""

    rank: int
    world_size: int
    local_rank: int


def cpu_threads(config: EngineConfig, world_size: int) -> int | None:
    """On CPU the ranks of one machine share its cores: each gets cores // world_size torch
    threads (None on CUDA). torch's thread count belongs to the thread that sets it, so each
    rank sets it in the thread that runs its steps."""
    if config.uses_cuda:
        return None
    return max(1, (os.cpu_count() or 1) // world_size)


def join_group(config: EngineConfig, place: RankPlace) -> dist.ProcessGroup:
    """On the rank's device (the Worker selects it first): rendezvous through env://
    (MASTER_ADDR, MASTER_PORT) and set this rank's place in parallel_state; returns the gloo
    group of step messages (a failed join leaves no group).
    The driver's end of that group times out after distributed_timeout_s like every
    collective; a worker's waits while the engine is idle."""
    cuda = config.uses_cuda
    timeout_s = config.parallel.distributed_timeout_s
    parallel_state.init_tensor_parallel(
        place.rank,
        place.world_size,
        backend="nccl" if cuda else "gloo",
        init_method="env://",
        timeout_s=timeout_s,
    )
    timeout = datetime.timedelta(seconds=timeout_s) if place.rank == 0 else WORKER_IDLE_TIMEOUT
    try:
        group = dist.new_group(backend="gloo", timeout=timeout)
    except BaseException:  # a join that fails leaves no group behind
        parallel_state.destroy_tensor_parallel()
        raise
    assert isinstance(group, dist.ProcessGroup)  # every rank is a member
    return group
