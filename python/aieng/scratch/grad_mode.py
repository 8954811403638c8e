"""Grad mode: whether operations record the graph. Per thread, as in torch."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_state = threading.local()


def is_grad_enabled() -> bool:
    return getattr(_state, "enabled", True)


@contextmanager
def no_grad() -> Iterator[None]:
    """Operations inside record no graph: their results do not require grad. Usable as a
    decorator too."""
    previous = is_grad_enabled()
    _state.enabled = False
    try:
        yield
    finally:
        _state.enabled = previous
