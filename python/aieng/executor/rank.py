"""How this process was started: a launcher (torchrun) that set RANK and WORLD_SIZE makes it one
rank of a tensor-parallel group."""

from __future__ import annotations

import os

from aieng.worker.device import RankPlace


def launched_place(tensor_parallel_size: int) -> RankPlace | None:
    """This process's RankPlace when a launcher set RANK and WORLD_SIZE for a group of
    tensor_parallel_size processes; None when nothing launched it so."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world == 1 and tensor_parallel_size == 1:
        return None
    if world != tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} but the launcher started "
            f"WORLD_SIZE={world} processes: one process per rank"
        )
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return RankPlace(rank, world, local_rank)
