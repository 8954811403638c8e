"""How many threads aieng's CPU kernels use, and keeping torch's OpenMP threads off their cores.

The kernels run on the Rust pool (`rust/src/kernels/pool.rs`) with the thread count torch has
(`torch.get_num_threads()`, what the user set or torch's default). torch's own intra-op threads
are OpenMP threads that spin for a while after every parallel region (libgomp's default wait
policy): a torch op between two kernel steps — sampling, a dtype conversion — leaves them
spinning on the very cores the pool's workers need next, and the two fight for every core. On a
2-core machine that made a native decode step 1.8x slower (one stream, base 134M, W4A8).

So while the native CPU decoder runs a step, `pool_owns_the_cores()` sets torch to one thread
(no parallel region starts, so no OpenMP thread wakes or spins) and remembers the count for
the kernels, which read it with `kernel_threads()`; the count is restored when the step ends,
so the user's own torch work between steps keeps its threads. No environment variable is read
or set: libgomp's behaviour is left to the user."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_scope = threading.local()  # the thread count of the step this thread runs, while it runs


def kernel_threads() -> int:
    """The threads a CPU kernel call may use: torch's count, or the one a step set aside."""
    threads = getattr(_scope, "threads", None)
    return threads if threads is not None else torch.get_num_threads()


@contextmanager
def pool_owns_the_cores() -> Iterator[int]:
    """Within it torch runs single-threaded and the kernels get torch's count (yielded)."""
    threads = kernel_threads()
    if getattr(_scope, "threads", None) is not None or threads == 1:  # nested, or nothing to do
        yield threads
        return
    _scope.threads = threads
    torch.set_num_threads(1)
    try:
        yield threads
    finally:
        torch.set_num_threads(threads)
        _scope.threads = None
