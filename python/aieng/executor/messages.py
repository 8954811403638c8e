"""What the driver (rank 0) tells the other ranks, one message per step, and how it travels.

A message is pickled once and broadcast over the gloo group of host messages: a fixed-size first
part that holds the length and, for most steps, the whole message (one broadcast), and the rest
in a second broadcast only when it does not fit. The step message carries the `RunnerStep`'s
dataclasses as they are and a plain copy of the core's `StepPlan` (a Rust object): the arrays
the plan contract (`aieng.worker.step_plan`) names, so a field added to the contract travels without
this module changing.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from aieng.worker.runner_io import RunnerStep
from aieng.worker.step_plan import STEP_ARRAYS, StepPlan

HEAD_BYTES = 16 << 10  # the first broadcast's size: a decode step of a few hundred rows fits
_LENGTH = np.dtype("<i8")


class PlanSnapshot:
    """A picklable copy of a StepPlan (`aieng.worker.step_plan.StepPlan`): every array of the
    contract, by the same names.

    The sampling-only part of the plan (`grammar_bitmask`, computed by the driver's core) is
    not copied: the ranks that receive a snapshot do not sample."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.__dict__.update(arrays)

    @classmethod
    def of(cls, plan: StepPlan) -> PlanSnapshot:
        return cls({name: getattr(plan, name) for name in STEP_ARRAYS})

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    def grammar_bitmask(self) -> None:
        raise RuntimeError(
            "a tensor-parallel rank > 0 does not sample: the grammar bitmask stays on the driver"
        )

    def __getattr__(self, name: str) -> Any:  # only for names missing from the snapshot
        raise AttributeError(f"the StepPlan snapshot has no field {name!r}")


@dataclass(frozen=True)
class Execute:
    """Run one engine step (`ModelRunner.execute`) on this rank."""

    step: RunnerStep

    @classmethod
    def of(cls, step: RunnerStep) -> Execute:
        snapshot: Any = PlanSnapshot.of(step.plan)  # stands in for the StepPlan on ranks > 0
        return cls(replace(step, plan=snapshot))


@dataclass(frozen=True)
class Call:
    """Call a Worker method on every rank (`Executor.collective_rpc`): one whose forward needs
    every rank (`prompt_logprobs`), or one each rank answers for itself. With reduce="min" every
    rank joins an all-reduce of its (integer) result, and all get the minimum."""

    method: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    reduce: str | None = None


REDUCTIONS = ("min",)


def run_call(worker: Any, call: Call) -> Any:
    """Runs `call` on this rank's worker (every rank does, rank 0 included)."""
    result = getattr(worker, call.method)(*call.args, **call.kwargs)
    if call.reduce is None:
        return result
    if call.reduce not in REDUCTIONS:
        raise ValueError(f"unknown reduction {call.reduce!r}: one of {', '.join(REDUCTIONS)}")
    import torch
    import torch.distributed as dist

    from aieng.distributed import parallel_state

    value = torch.tensor([int(result)], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=parallel_state.get_cpu_group())
    return int(value.item())


@dataclass(frozen=True)
class Shutdown:
    """The driver is closing: leave the group and exit."""


Message = Execute | Call | Shutdown


def broadcast_message(message: Message, group: dist.ProcessGroup) -> None:
    """Rank 0: send `message` to every rank of `group`."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    head = np.zeros(HEAD_BYTES, np.uint8)
    head[:8] = np.frombuffer(np.array([len(payload)], _LENGTH).tobytes(), np.uint8)
    first = min(len(payload), HEAD_BYTES - 8)
    head[8 : 8 + first] = np.frombuffer(payload[:first], np.uint8)
    dist.broadcast(torch.from_numpy(head), src=0, group=group)
    if first < len(payload):
        rest = np.frombuffer(payload[first:], np.uint8).copy()
        dist.broadcast(torch.from_numpy(rest), src=0, group=group)


def receive_message(group: dist.ProcessGroup) -> Message:
    """Ranks > 0: the next message rank 0 broadcasts (waits as long as the group allows)."""
    head = torch.zeros(HEAD_BYTES, dtype=torch.uint8)
    dist.broadcast(head, src=0, group=group)
    raw = head.numpy()
    length = int(raw[:8].view(_LENGTH)[0])
    first = min(length, HEAD_BYTES - 8)
    payload = raw[8 : 8 + first].tobytes()
    if first < length:
        rest = torch.zeros(length - first, dtype=torch.uint8)
        dist.broadcast(rest, src=0, group=group)
        payload += rest.numpy().tobytes()
    return pickle.loads(payload)
