"""Check suites for tests/test_kernel_start_checks.py, in a module of their own that imports
neither torch nor aieng, so that the child process that runs them starts in a fraction of a
second: kernels that pass, fail, abort, segfault, raise or hang."""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable, Iterator

CALLS: list[str] = []  # the checks run in this process


def fault(kind: str) -> bool:
    if kind == "abort":
        os.abort()
    if kind == "segfault":
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    if kind == "hang":
        time.sleep(600)
    if kind == "raise":
        raise RuntimeError("injected")
    if kind == "fail":
        logging.getLogger("aieng.kernels.self_check").warning("kernel_%s differs (child)", kind)
    return kind.startswith("pass")


def suite(*kinds: str) -> Iterator[tuple[str, Callable[[], bool]]]:
    """One kernel per kind, named kernel_KIND, whose check does what the kind says."""

    def check(name: str, kind: str) -> Callable[[], bool]:
        def run() -> bool:
            CALLS.append(name)
            return fault(kind)

        return run

    for kind in kinds:
        yield f"kernel_{kind}", check(f"kernel_{kind}", kind)


def broken_suite() -> Iterator[tuple[str, Callable[[], bool]]]:
    raise RuntimeError("cannot even list the kernels")
    yield  # a generator
