"""Fuzzes the engine for --minutes: the state machine of tests/engine_fuzz_machine.py (random
requests, aborts and steps on a tiny model with a small KV cache), fresh randomness each batch,
and prints a table of what it tried and every distinct failure with hypothesis' shrunk steps.

    .venv/bin/python benches/fuzz_engine.py --minutes 5
"""

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from engine_fuzz_machine import STATS, EngineMachine, Engines
from fuzz_runs import print_table, run_until
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--examples-per-batch", type=int, default=50)
    ap.add_argument("--steps", type=int, default=40, help="rules per example")
    args = ap.parse_args()
    logging.getLogger("aieng").setLevel(logging.CRITICAL)  # requests that end with "error"
    with tempfile.TemporaryDirectory() as folder:
        EngineMachine.engines = Engines(Path(folder))
        batch = settings(
            max_examples=args.examples_per_batch,
            stateful_step_count=args.steps,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        started = time.monotonic()
        bugs = run_until(
            started + 60 * args.minutes,
            lambda: run_state_machine_as_test(EngineMachine, settings=batch),
            lambda line: print(f"[{time.monotonic() - started:6.0f} s] {line}", flush=True),
        )
    title = f"Engine fuzzing, {time.monotonic() - started:.0f} s"
    print_table(title, STATS.table(), bugs)


if __name__ == "__main__":
    main()
