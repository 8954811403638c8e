"""One tensor-parallel rank's set-up, the same on the driver and on every worker: join the group,
pick the device and the CPU threads, open the group of step messages, build the rank's runner."""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from aieng.distributed import parallel_state
from aieng.engine_args import EngineArgs
from aieng.runner import ModelRunner

# Workers wait for the next step message as long as the engine stays idle; a dead driver still
# ends the wait at once (its connection closes).
WORKER_IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where one rank sits: its rank, the group's size, its device index on its machine."""

    rank: int
    world_size: int
    local_rank: int


def uses_cuda(args: EngineArgs) -> bool:
    if args.device == "auto":
        return torch.cuda.is_available()
    return args.device.startswith("cuda")


def rank_args(args: EngineArgs, place: RankPlace) -> EngineArgs:
    """This rank's options: on CUDA its own device, cuda:{local_rank}."""
    if not uses_cuda(args):
        return args
    return dataclasses.replace(args, device=f"cuda:{place.local_rank}")


def cpu_threads(args: EngineArgs, world_size: int) -> int | None:
    """On CPU the ranks of one machine share its cores: each gets cores // world_size torch
    threads (None on CUDA). torch's thread count belongs to the thread that sets it, so each
    rank sets it in the thread that runs its steps."""
    if uses_cuda(args):
        return None
    return max(1, (os.cpu_count() or 1) // world_size)


def join_group(args: EngineArgs, place: RankPlace) -> dist.ProcessGroup:
    """Rendezvous through env:// (MASTER_ADDR, MASTER_PORT) and set this rank's place in
    parallel_state; returns the gloo group of step messages. The driver's end of that group
    times out after distributed_timeout_s like every collective; a worker's waits while the
    engine is idle."""
    cuda = uses_cuda(args)
    if cuda:
        torch.cuda.set_device(place.local_rank)
    parallel_state.init_tensor_parallel(
        place.rank,
        place.world_size,
        backend="nccl" if cuda else "gloo",
        init_method="env://",
        timeout_s=args.distributed_timeout_s,
    )
    timeout = (
        datetime.timedelta(seconds=args.distributed_timeout_s)
        if place.rank == 0
        else WORKER_IDLE_TIMEOUT
    )
    group = dist.new_group(backend="gloo", timeout=timeout)
    assert isinstance(group, dist.ProcessGroup)  # every rank is a member
    return group


class RankRunner(ModelRunner):
    """A ModelRunner that is one rank of a tensor-parallel group.

    Every rank must hold the same number of KV blocks (the core's accounting on the driver is
    the only one), so each takes the minimum over the ranks of what its memory allows. Ranks
    other than the driver run the model but do not sample (`samples`): their logits
    all-gather still joins the collective, and the grammar masks stay with the driver's core."""

    def __init__(self, args: EngineArgs, eos_token_ids: Sequence[int], samples: bool):
        self.samples = samples
        super().__init__(args, eos_token_ids=eos_token_ids)

    def _num_blocks(self, args: EngineArgs) -> int:
        own = super()._num_blocks(args)
        count = torch.tensor([own], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=parallel_state.get_cpu_group())
        return int(count.item())
