"""The start-up checks' child process (`aieng.kernels.check_child`), on the CPU: a check that
aborts, segfaults, raises or hangs in the child turns off only its kernel, by name, with a
warning; the checks after it still run (in a new child); the parent then runs only what passed
there, and the child's warnings reach the parent's log."""

from __future__ import annotations

import logging

import pytest
from start_check_suites import CALLS, broken_suite, suite

from aieng.kernels.check_child import checked_names, screen_in_child

KINDS = ("pass", "abort", "fail", "segfault", "raise", "pass2", "hang")


def test_faulting_checks_cost_their_kernels_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    CALLS.clear()
    with caplog.at_level(logging.WARNING):
        passed = checked_names(suite, KINDS[:-1], isolate=True, timeout_s=60)
    assert passed == {"kernel_pass", "kernel_pass2"}  # pass2 ran in a third child
    assert CALLS == ["kernel_pass", "kernel_pass2"]  # the parent ran only what passed there
    for kind, why in (("abort", "died of signal SIGABRT"), ("segfault", "died of signal SIGSEGV")):
        assert f"kernel kernel_{kind} {why} during its start-up check" in caplog.text
    assert "kernel kernel_raise: its check raised RuntimeError('injected')" in caplog.text
    record = next(r for r in caplog.records if "differs (child)" in r.getMessage())
    assert record.name == "aieng.kernels.self_check"  # forwarded under the child's logger


def test_screening_names_why_each_kernel_is_off() -> None:
    screening = screen_in_child(suite, KINDS, timeout_s=5)
    assert screening.passed == ["kernel_pass", "kernel_pass2"] and screening.error is None
    assert screening.failed == {
        "kernel_abort": "died of signal SIGABRT during its check",
        "kernel_fail": "failed its check",
        "kernel_segfault": "died of signal SIGSEGV during its check",
        "kernel_raise": "failed its check",
        "kernel_hang": "did not finish within 5 s during its check",
    }


def test_without_isolation_everything_runs_here() -> None:
    CALLS.clear()
    assert checked_names(suite, ("pass", "fail", "pass"), isolate=False) == {"kernel_pass"}
    assert CALLS == ["kernel_pass", "kernel_fail", "kernel_pass"]


def test_a_suite_that_cannot_start_turns_everything_off(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        screening = screen_in_child(broken_suite, (), timeout_s=60, label="test")
    assert screening.passed == [] and "cannot even list the kernels" in (screening.error or "")
    assert "the test start-up checks could not run in a child process" in caplog.text
