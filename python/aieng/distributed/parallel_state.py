"""This process's place in the tensor-parallel group, and the collectives the model layers use.

Before `init_tensor_parallel` (or after `destroy_tensor_parallel`) the process is rank 0 of a
group of one and every collective is the identity, so model code calls them unconditionally.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class _State:
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None  # the tensor-parallel group (NCCL or gloo)
    cpu_group: dist.ProcessGroup | None = None  # gloo, for host-side messages


_state = _State()


def init_tensor_parallel(
    rank: int,
    world_size: int,
    backend: str = "gloo",
    init_method: str = "env://",
    timeout_s: float = 60.0,
) -> None:
    """Join the default process group (rendezvous through `init_method`: env:// reads
    MASTER_ADDR, MASTER_PORT; tcp://host:port names it) as `rank` of `world_size`; every rank is
    one tensor-parallel rank. `timeout_s` bounds every collective: a peer that died or hangs
    makes the others raise instead of waiting forever.

    A join that fails leaves this process as it found it (no group, torch's group names counting
    from the start again), so that a later join here can succeed."""
    joined = not dist.is_initialized()
    if joined:
        try:
            dist.init_process_group(
                backend=backend,
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except BaseException:
            _forget_failed_init()
            raise
    elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise ValueError(
            f"this process already belongs to a torch.distributed group as rank "
            f"{dist.get_rank()} of {dist.get_world_size()}, not rank {rank} of {world_size}"
        )
    try:
        group = dist.group.WORLD
        cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo")
    except BaseException:
        if joined:
            destroy_tensor_parallel()
        raise
    _state.rank, _state.world_size = rank, world_size
    _state.group, _state.cpu_group = group, cpu_group


def _forget_failed_init() -> None:
    """torch names every process group by a process-wide count that `init_process_group`
    advances before its rendezvous, and only `destroy_process_group` — which needs a group
    that formed — sets it back. After a failed rendezvous the count stays advanced: this
    process's next default group would be named "1" while the fresh ranks it meets name theirs
    "0", and each side would wait for the other's keys until the timeout. Set it back here."""
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        distributed_c10d._world.group_count = 0


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _state.rank, _state.world_size, _state.group, _state.cpu_group = 0, 1, None, None


def get_tp_rank() -> int:
    return _state.rank


def get_tp_world_size() -> int:
    return _state.world_size


def get_tp_group() -> dist.ProcessGroup | None:
    return _state.group


def get_cpu_group() -> dist.ProcessGroup | None:
    return _state.cpu_group


def tp_all_reduce(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Sum of `x` over the ranks (in place when x is contiguous; use the returned tensor).

    `world_size` is the group size the calling layer was built for (read at construction):
    a layer of a one-rank model never joins a collective, even in a process that holds a
    tensor-parallel group for another engine."""
    if world_size == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=_state.group)
    return x


def tp_all_gather(x: torch.Tensor, world_size: int, dim: int = -1) -> torch.Tensor:
    """The ranks' `x` concatenated along `dim`, in rank order (`world_size`: as in
    tp_all_reduce)."""
    if world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.group)
    return torch.cat(parts, dim=dim)


def shard_range(size: int, what: str) -> tuple[int, int]:
    """[start, end) of this rank's equal share of `size` items (heads, columns, vocab rows);
    raises ValueError naming `what` when the ranks cannot share it equally."""
    n = _state.world_size
    if size % n:
        raise ValueError(f"{what}: {size} is not divisible by tensor_parallel_size {n}")
    per = size // n
    return _state.rank * per, (_state.rank + 1) * per


# Attention heads per rank (Megatron-LM's split; vLLM's rule for fewer KV heads than ranks): read
# by the layers that shard q/k/v and by the KV cache and backends that size per-rank heads.


def heads_per_rank(num_heads: int) -> int:
    start, end = shard_range(num_heads, "num_attention_heads")
    return end - start


def kv_heads_per_rank(num_kv_heads: int) -> int:
    """KV heads split evenly, or (fewer heads than ranks) one replicated head per rank."""
    return kv_head_range(num_kv_heads)[1]


def kv_head_range(num_kv_heads: int) -> tuple[int, int]:
    """(first KV head, count) this rank holds."""
    n = get_tp_world_size()
    if num_kv_heads >= n:
        start, end = shard_range(num_kv_heads, "num_key_value_heads")
        return start, end - start
    if n % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads: {num_kv_heads} KV heads cannot be replicated evenly over "
            f"tensor_parallel_size {n} (it must be a multiple of them)"
        )
    return get_tp_rank() // (n // num_kv_heads), 1
