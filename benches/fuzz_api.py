"""Fuzzes a live server for --minutes from the OpenAPI document it publishes: the checks of
tests/api_fuzz.py (schemathesis, every operation, valid, invalid and steered inputs), fresh
randomness each round, on an in-process server over a tiny model; prints a table of what it
tried and every distinct failure.

    .venv/bin/python benches/fuzz_api.py --minutes 5
"""

import argparse
import itertools
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import schemathesis
from api_fuzz import STATS, fuzz_operation, operations
from fuzz_runs import print_table, run_until
from server_fixtures import ThreadServer, make_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--examples", type=int, default=100, help="per operation and mode a round")
    args = ap.parse_args()
    logging.getLogger("aieng").setLevel(logging.CRITICAL)  # the refused requests' log lines
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        model = make_model_dir(Path(folder))
        with ThreadServer(model, engine={"max_model_len": 64}, max_queue_requests=8) as server:
            schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
            # One operation a batch, round after round, until the time is up.
            todo = itertools.cycle(operations(schema))

            def one_operation() -> None:
                fuzz_operation(schema, *next(todo), max_examples=args.examples)

            bugs = run_until(
                started + 60 * args.minutes,
                one_operation,
                lambda line: print(f"[{time.monotonic() - started:6.0f} s] {line}", flush=True),
            )
            server.wait_idle()
            server.in_engine(lambda engine: engine.check_pool_whole())
            alive = server.ctx.engine.alive
    rows = [*STATS.table(), ("engine alive at the end, pool whole", alive)]
    print_table(f"API fuzzing, {time.monotonic() - started:.0f} s", rows, bugs)


if __name__ == "__main__":
    main()
