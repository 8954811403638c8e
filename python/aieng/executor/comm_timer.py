"""How long this rank spends in torch.distributed collectives: a benchmark's profiler hook.

`timed_collectives()` wraps torch.distributed's broadcast, all_reduce and all_gather (what the
step messages and the model's parallel layers call) for the length of a `with` block and sums
the wall time of each. On gloo (CPU) a collective returns when it is done, so the sum is the
time this rank spent communicating — including any wait for a slower rank. On NCCL a collective
only enqueues work on the stream, so the figures would undercount; time on CPU only.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

TIMED = ("broadcast", "all_reduce", "all_gather")


@dataclass
class CollectiveTimes:
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


@contextmanager
def timed_collectives() -> Iterator[CollectiveTimes]:
    times = CollectiveTimes()
    originals = {name: getattr(dist, name) for name in TIMED}

    def timed(name: str, collective):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return collective(*args, **kwargs)
            finally:
                times.seconds[name] += time.perf_counter() - start
                times.calls[name] += 1

        return run

    for name, collective in originals.items():
        setattr(dist, name, timed(name, collective))
    try:
        yield times
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
