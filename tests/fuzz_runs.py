"""Runs a hypothesis test again and again, with fresh randomness, until a deadline; collects
the distinct failures it finds (for benches/fuzz_engine.py and benches/fuzz_api.py)."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable


def failures_of(error: BaseException) -> list[BaseException]:
    inner = getattr(error, "exceptions", None)  # an exception group (hypothesis, schemathesis)
    if inner:
        return [f for e in inner for f in failures_of(e)]
    return [error]


def summary(error: BaseException) -> str:
    """The error's type, its first message line and where it was raised."""
    frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    where = f" ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})" if frame else ""
    message = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {message}{where}"


def run_until(deadline: float, run_batch: Callable[[], None], log: Callable[[str], None]) -> dict:
    """Calls run_batch() until time.monotonic() passes `deadline`; returns {summary: the first
    full report (hypothesis' shrunk steps)} of each distinct failure."""
    bugs: dict[str, str] = {}
    batches = 0
    while time.monotonic() < deadline:
        batches += 1
        try:
            run_batch()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # a found bug: note it, go on with fresh randomness
            for failure in failures_of(error):
                key = summary(failure)
                if key not in bugs:
                    notes = "\n".join(getattr(failure, "__notes__", []))
                    bugs[key] = f"{key}\n{notes}"
                    log(f"batch {batches}: found {key}")
    return bugs


def print_table(title: str, rows: list[tuple[str, object]], bugs: dict[str, str]) -> None:
    width = max(len(name) for name, _ in rows)
    print(f"\n{title}\n")
    print(f"| {'what':<{width}} | count |")
    print(f"|{'-' * (width + 2)}|-------|")
    for name, value in rows:
        print(f"| {name:<{width}} | {value} |")
    print(f"| {'distinct failures found':<{width}} | {len(bugs)} |")
    for report in bugs.values():
        print("\n" + report)
