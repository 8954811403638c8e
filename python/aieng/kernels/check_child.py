"""Start-up checks run first in a child process, so that a kernel that faults, aborts or hangs
during its check costs a warning naming it and the torch fallback — never the engine. (An
illegal-address fault leaves the CUDA context of its process unusable, and can surface at any
later call, outside the check's `try`.)

A suite is a module-level function `suite(*args) -> Iterable[(name, check)]`: each `check()`
runs one kernel's start-up check in the calling process and returns whether it passed.
`screen_in_child` runs a suite in a fresh interpreter (this file run as a script), which
reports each check as it starts and ends over a pipe and forwards its warnings; a check
that is running when the child dies or overruns its time is that kernel's fault, and a new
child runs the checks not yet done. `checked_names` runs a suite in this process — on a CUDA
device only the checks that passed in the child — and returns the names that passed.

A child costs a few seconds (it imports torch and makes its own CUDA context), so callers
screen once per process for each device and kind of kernel, and only for CUDA devices.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# How long a child may go without reporting (its start, then each check) before the check in
# progress counts as hung: NVRTC compiles a cold cache's kernels inside the checks (seconds
# each), and a device run's part has minutes in all (benches/gpu/run.sh sets 60 s), so a hung
# kernel must cost a bounded share of it. AIENG_CHECK_TIMEOUT_S overrides the default.
DEFAULT_CHILD_TIMEOUT_S = 120.0


def child_timeout_s() -> float:
    """AIENG_CHECK_TIMEOUT_S (seconds, > 0) or DEFAULT_CHILD_TIMEOUT_S."""
    text = os.environ.get("AIENG_CHECK_TIMEOUT_S", "")
    if not text:
        return DEFAULT_CHILD_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"AIENG_CHECK_TIMEOUT_S must be a positive number of seconds: {text!r}")
    return value


Suite = Callable[..., Iterable[tuple[str, Callable[[], bool]]]]


@dataclass
class Screening:
    """What a suite's child processes found: the checks that passed, and per kernel that did
    not, why (failed its check, faulted, overran)."""

    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    error: str | None = None  # a child that died outside any check: nothing after it is known


@dataclass
class _ChildRun:
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    running: str | None = None  # the check in progress when the child stopped reporting
    death: str | None = None  # why the child stopped before finishing the suite
    names: list[str] | None = None  # the checks the child was to run, once it has said
    finished: bool = False

    @property
    def settled(self) -> bool:
        """Every check the child was to run has passed or failed."""
        return self.names is not None and set(self.names) <= {*self.passed, *self.failed}


def screen_in_child(
    suite: Suite, args: tuple[Any, ...], timeout_s: float | None = None, label: str = ""
) -> Screening:
    """Runs `suite(*args)`'s checks in child processes (each check, and the child's start,
    allowed `timeout_s`, default `child_timeout_s()`): a check whose child dies (a fault, an
    abort) or overruns is that kernel's failure, logged by name, and a new child runs the rest.
    `label` names the suite in warnings."""
    screening = Screening()
    timeout_s = child_timeout_s() if timeout_s is None else timeout_s
    label = label or getattr(suite, "__name__", "kernel")
    while True:
        skip = set(screening.passed) | set(screening.failed)
        run = _run_child(suite, args, skip, timeout_s)
        screening.passed += run.passed
        screening.failed.update(run.failed)
        if run.finished:
            return screening
        if run.running is None:  # died before or between checks: nothing to blame or go on to
            screening.error = run.death
            logger.warning(
                "the %s start-up checks could not run in a child process (%s); kernels not yet "
                "checked are turned off",
                label,
                run.death,
            )
            return screening
        screening.failed[run.running] = run.failed[run.running] = f"{run.death} during its check"
        logger.warning(
            "kernel %s %s during its start-up check (in a child process); it is turned off",
            run.running,
            run.death,
        )
        if run.settled:  # it was the last: no new child needed
            return screening


def checked_names(
    suite: Suite,
    args: tuple[Any, ...],
    isolate: bool,
    timeout_s: float | None = None,
    label: str = "",
) -> frozenset[str]:
    """The names of `suite(*args)`'s checks that pass in this process; with `isolate` (a CUDA
    device) only those that passed in a child process first are run here."""
    screened = set(screen_in_child(suite, args, timeout_s, label).passed) if isolate else None
    return frozenset(
        name for name, check in suite(*args) if (screened is None or name in screened) and check()
    )


def _run_child(suite: Suite, args: tuple[Any, ...], skip: set[str], timeout_s: float) -> _ChildRun:
    read_fd, write_fd = os.pipe()
    # Run by path, not as aieng.kernels.check_child: the package would import torch before the
    # child has read the parent's sys.path (the suite's own imports bring what it needs).
    # -P (3.11+): this file's folder is not put first on the path, where its modules' names
    # could hide the standard library's.
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    command = [sys.executable, *safe_path, os.path.abspath(__file__), str(write_fd)]
    try:
        child = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=(write_fd,))
    finally:
        os.close(write_fd)
    run = _ChildRun()
    try:
        assert child.stdin is not None
        try:
            child.stdin.write(pickle.dumps(sys.path) + pickle.dumps((suite, args, skip)))
            child.stdin.close()
        except BrokenPipeError:
            pass  # the child died at once: its exit status says why
        _follow(child, read_fd, run, time.monotonic() + timeout_s, timeout_s)
    finally:
        os.close(read_fd)
        if child.poll() is None:
            child.kill()
        child.wait()
    return run


def _follow(
    child: subprocess.Popen, read_fd: int, run: _ChildRun, deadline: float, timeout_s: float
) -> None:
    """Reads the child's reports into `run` until it finishes, dies or overruns."""
    pending = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            child.kill()
            run.death = f"did not finish within {timeout_s:g} s"
            return
        ready, _, _ = select.select([read_fd], [], [], min(remaining, 1.0))
        if not ready:
            continue
        data = os.read(read_fd, 1 << 16)
        if not data:  # every write end closed: the child exited
            status = child.wait()
            if not run.finished and run.death is None:
                run.death = _exit_reason(status)
            return
        deadline = time.monotonic() + timeout_s  # the time allowed is per check, not in all
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            _report(json.loads(line), run)


def _report(message: dict[str, Any], run: _ChildRun) -> None:
    kind = message["kind"]
    if kind == "start":
        run.running = message["name"]
    elif kind == "end":
        if message["passed"]:
            run.passed.append(message["name"])
        else:
            run.failed[message["name"]] = "failed its check"
        run.running = None
    elif kind == "log":
        logging.getLogger(message["logger"]).log(message["level"], "%s", message["message"])
    elif kind == "names":
        run.names = list(message["names"])
    elif kind == "error":
        run.death = f"the suite raised {message['error']}"
    elif kind == "finished":
        run.finished = True


def _exit_reason(status: int) -> str:
    if status < 0:
        try:
            return f"died of signal {signal.Signals(-status).name}"
        except ValueError:
            return f"died of signal {-status}"
    return f"exited with status {status}"


# ------------------------------------------------------------------ the child's side


class _Forward(logging.Handler):
    """Sends each log record to the parent, which logs it under the same logger."""

    def __init__(self, send: Callable[[dict[str, Any]], None]):
        super().__init__(logging.WARNING)
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        self.send(
            {"kind": "log", "logger": record.name, "level": record.levelno,
             "message": record.getMessage()}
        )  # fmt: skip


def _child_main(write_fd: int) -> None:
    out = os.fdopen(write_fd, "w", buffering=1)

    def send(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    sys.path[:] = pickle.load(sys.stdin.buffer)
    root = logging.getLogger()
    root.handlers[:] = [_Forward(send)]
    root.setLevel(logging.WARNING)
    try:
        suite, args, skip = pickle.load(sys.stdin.buffer)
        checks = [(name, check) for name, check in suite(*args) if name not in skip]
    except Exception as error:  # the suite itself, not a check
        send({"kind": "error", "error": f"{type(error).__name__}: {error}"})
        return
    send({"kind": "names", "names": [name for name, _ in checks]})
    for name, check in checks:
        send({"kind": "start", "name": name})
        try:
            passed = bool(check())
        except Exception as error:  # checks catch their own; one that does not fails
            logging.getLogger(__name__).warning("kernel %s: its check raised %r", name, error)
            passed = False
        send({"kind": "end", "name": name, "passed": passed})
    send({"kind": "finished"})


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
