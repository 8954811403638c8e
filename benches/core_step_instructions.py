"""Instructions per engine step of the Rust core, counted by valgrind's callgrind: unlike a
timing on a shared machine, a count is the same from run to run.

The workload is bench_core.py's (256 requests, prompt and output lengths U[100, 1024], seed 0,
ignore_eos, prefix caching, budget 2048 tokens, block size 16 unless --block-size). A driver runs
it under callgrind collecting only inside the bindings' schedule() and update() and the plan's
column getters (the Rust step, the numpy arrays of the plan included: bench_core.py's runner
columns are read each step, as a model runner reads them; the plan's deallocation and the Python
loop are not),
and marks the full-load window (256 requests running) by calling check_invariants() at its
first step and after its last, where callgrind dumps (--dump-before): the second dump holds
the window's steps alone. Each core is counted: this checkout's, and the previous release's
(benches/previous_core.py) unless --no-previous.

    .venv/bin/python benches/core_step_instructions.py [--steps 64] [--out benches/results]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

# The plan's columns are numpy views made when first read (a core whose plan holds ready
# arrays answers a read with pyo3's generic field getter, not counted: a reference count).
TOGGLES = (
    "*__pymethod_schedule__*",
    "*__pymethod_update__*",
    "*PyStepPlan::__pymethod_get_*",
)
MARK = "*__pymethod_check_invariants__*"


def drive(core_dir: str | None, requests: int, block_size: int, budget: int, steps: int) -> None:
    """Runs the workload through its first `steps` steps at full load, or until a request
    finishes (check_invariants() before the first of them and after the last); prints the
    number of steps in the window."""
    import numpy as np
    from bench_core import CORE, CORE_FIELDS, build, workload

    engine = build(
        workload(requests), requests, block_size, CORE, budget, core_dir and Path(core_dir)
    )
    sampled = np.random.default_rng(1).integers(3, 32000, size=1 << 20, dtype=np.int64)
    offset, window, started = 0, 0, False
    while engine.has_unfinished() and window < steps:
        full = engine.num_running == requests
        if started and not full:
            break  # a request finished: the window ends with the last full-load step
        if full and not started:
            engine.check_invariants()  # the window starts: callgrind dumps here
            started = True
        plan = engine.schedule()
        arrays = [getattr(plan, f) for f in CORE_FIELDS]
        n = len(arrays[CORE_FIELDS.index("logits_indices")])
        engine.update(sampled[offset : offset + n])
        offset = (offset + n) % (len(sampled) - 4096)
        window += started
    engine.check_invariants()  # the window ends
    print(json.dumps({"window_steps": window}))


def count(core_dir: str | None, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        command = [
            "valgrind", "--tool=callgrind", "--collect-atstart=no",
            *(f"--toggle-collect={t}" for t in TOGGLES), f"--dump-before={MARK}",
            f"--callgrind-out-file={out}",
            sys.executable, __file__, "--drive", core_dir or "",
            "--requests", str(args.requests), "--block-size", str(args.block_size),
            "--budget", str(args.budget), "--steps", str(args.steps),
        ]  # fmt: skip
        env = dict(os.environ, PYTHONHASHSEED="0")  # the same Python-side run every time
        done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
        window = json.loads(done.stdout.strip().splitlines()[-1])
        dumps = sorted(Path(tmp).glob("callgrind.out*"), key=dump_number)
        totals = [total(d) for d in dumps]
    if len(totals) < 3:
        raise RuntimeError(f"expected 3 callgrind dumps or more, got {len(totals)}: {totals}")
    steps = window["window_steps"]
    return {
        "window_steps": steps,
        "instructions_before_window": totals[0],
        "instructions_in_window": totals[1],
        "instructions_per_step": totals[1] / steps,
    }


def dump_number(path: Path) -> int:
    """callgrind.out.N (N = 1, 2, ...) in order; the final dump (no suffix) last."""
    suffix = path.name.rsplit(".", 1)[-1]
    return int(suffix) if suffix.isdigit() else 1 << 30


def total(dump: Path) -> int:
    text = dump.read_text()
    found = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
    return int(found.group(1)) if found else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--steps", type=int, default=64, help="most full-load steps counted")
    ap.add_argument("--no-previous", action="store_true")
    ap.add_argument(
        "--previous-commit", default=None,
        help="comma-separated commits counted beside this checkout (default: the previous release)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--drive", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive is not None:
        drive(args.drive or None, args.requests, args.block_size, args.budget, args.steps)
        return
    rows = [{"core": "this checkout", **count(None, args)}]
    print(rows[-1], flush=True)
    if not args.no_previous:
        import previous_core

        for commit in (args.previous_commit or previous_core.PREVIOUS).split(","):
            name = "previous release" if commit == previous_core.PREVIOUS else "commit"
            folder = str(previous_core.build(commit))
            rows.append({"core": f"{name} {commit}", **count(folder, args)})
            print(rows[-1], flush=True)
    valgrind = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout
    md = [
        "# Instructions per step of the Rust core (benches/core_step_instructions.py)",
        "",
        f"bench_core.py's workload: {args.requests} requests, block size {args.block_size}, "
        f"budget {args.budget} tokens; the steps at full load ({args.requests} running, at "
        f"most {args.steps}, until the first request finishes) counted by callgrind inside the "
        "bindings' schedule() and update() and the plan's column getters (the plan's numpy "
        "arrays included, bench_core.py's runner columns read each step; its deallocation "
        f"not). {valgrind.strip()}. Counts repeat to within 0.1% from run to run "
        "on one build (the allocator's state differs by a few instructions); timings on this "
        "shared machine do not. `python benches/core_step_instructions.py`.",
        "",
        "| core | steps counted | instructions per step |",
        "|---|---|---|",
        *(
            f"| {r['core']} | {r['window_steps']} | {r['instructions_per_step']:,.0f} |"
            for r in rows
        ),
        "",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_core_instructions.md").write_text("\n".join(md))
    (args.out / "bench_core_instructions.json").write_text(json.dumps(rows, indent=2))
    print("\n".join(md))


if __name__ == "__main__":
    main()
