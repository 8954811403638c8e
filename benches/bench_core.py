"""Microseconds per engine step of the Rust core, driven by synthetic model outputs.

256 requests with prompt and output lengths uniform in [100, 1024] (seed 0,
ignore_eos), prefix caching on, block sizes 16 and 256. Each step calls
schedule(), reads the plan arrays a model runner reads (the core's new blocks for
its persistent block table; the peer's dense block table), and calls update() with
random sampled tokens. The workload runs --repeats times and the timings are pooled.
Peer in the same run: the same step in plain Python (benches/python_scheduler.py,
nano-vllm style). --previous adds the previous release's core (benches/previous_core.py builds
it once, commit e346e0b unless --previous-commit says otherwise), run in a process of its own,
so that a regression shows beside the figure it regresses from. Timings on a shared machine
vary; benches/core_step_instructions.py counts the instructions of the same step (repeatable).

    .venv/bin/python benches/bench_core.py [--requests 256] [--previous] [--out benches/results]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from python_scheduler import PyScheduler

CORE = "aieng (Rust core)"
PEER = "plain Python peer"

RUNNER_FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "num_computed_tokens",
    "seq_lens",
    "logits_indices",
    "sample_request_rows",
    "slots",
)
CORE_FIELDS = (*RUNNER_FIELDS, "new_block_slots", "new_block_indices", "new_block_ids")
PEER_FIELDS = (*RUNNER_FIELDS, "block_tables")


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(100, 1025, size=n)
    outputs = rng.integers(100, 1025, size=n)
    return [
        (rng.integers(0, 32000, size=int(p)).tolist(), int(o))
        for p, o in zip(prompts, outputs, strict=True)
    ]


def drive(engine, sampled_pool: np.ndarray, max_num_seqs: int) -> tuple[list, list, int]:
    """Runs to completion; returns the step times (ns) at full load, of every step, and
    the number of tokens generated."""
    full_load, every = [], []
    generated, offset = 0, 0
    logits = RUNNER_FIELDS.index("logits_indices")
    while engine.has_unfinished():
        start = time.perf_counter_ns()
        plan = engine.schedule()
        if isinstance(plan, dict):
            arrays = [plan[f] for f in PEER_FIELDS]
        else:
            arrays = [getattr(plan, f) for f in CORE_FIELDS]
        n_samples = len(arrays[logits])
        tokens = sampled_pool[offset : offset + n_samples]
        engine.update(tokens)
        elapsed = time.perf_counter_ns() - start
        offset = (offset + n_samples) % (len(sampled_pool) - 4096)
        generated += n_samples
        every.append(elapsed)
        if engine.num_running == max_num_seqs or (
            len(arrays[0]) == max_num_seqs and n_samples == max_num_seqs
        ):
            full_load.append(elapsed)
    return full_load, every, generated


def summary(full_load: list, every: list, generated: int, runs: int) -> dict[str, float]:
    every_us = np.array(every) / 1e3
    full_us = np.array(full_load) / 1e3 if full_load else np.array([np.nan])
    return {
        "runs": runs,
        "steps": len(every) // runs,
        "full_load_steps": len(full_load),
        "us_per_step_full_load_mean": float(full_us.mean()),
        "us_per_step_full_load_p50": float(np.median(full_us)),
        "us_per_step_full_load_p99": float(np.percentile(full_us, 99)),
        "us_per_step_mean": float(every_us.mean()),
        "us_per_generated_token": float(every_us.sum() / max(generated, 1)),
        "generated_tokens": generated,
    }


def core_class(core_dir: Path | None):
    """EngineCore of this checkout, or of the `_core` extension in `core_dir` (a previous
    release's, benches/previous_core.py)."""
    if core_dir is None:
        from aieng.core import EngineCore

        return EngineCore
    sys.path.insert(0, str(core_dir))
    from _core import EngineCore

    return EngineCore


def run(
    requests: int,
    block_size: int,
    engine_name: str,
    budget: int,
    repeats: int,
    core_dir: Path | None = None,
) -> dict:
    work = workload(requests)
    sampled_pool = np.random.default_rng(1).integers(3, 32000, size=1 << 20, dtype=np.int64)
    full_load, every, generated = [], [], 0
    for _ in range(repeats):
        engine = build(work, requests, block_size, engine_name, budget, core_dir)
        full, all_steps, tokens = drive(engine, sampled_pool, requests)
        full_load += full
        every += all_steps
        generated += tokens
        if engine_name != PEER:
            engine.check_invariants()
            stats = engine.stats()["pool"]
            assert stats["num_free_blocks"] == stats["num_blocks"]
    result = summary(full_load, every, generated, repeats)
    return {"engine": engine_name, "block_size": block_size, **result}


def build(
    work: list,
    requests: int,
    block_size: int,
    engine_name: str,
    budget: int,
    core_dir: Path | None = None,
):
    num_blocks = sum(-(-(len(p) + o) // block_size) for p, o in work) + 16
    if engine_name != PEER:
        engine = core_class(core_dir)(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=requests,
            max_num_batched_tokens=budget,
            max_model_len=4096,
            enable_prefix_caching=True,
        )
        for i, (prompt, out) in enumerate(work):
            engine.add_request(f"r{i}", prompt, max_tokens=out, ignore_eos=True)
    else:
        engine = PyScheduler(num_blocks, block_size, requests, budget)
        for i, (prompt, out) in enumerate(work):
            engine.add(f"r{i}", prompt, out)
    return engine


def table(rows: list[dict]) -> str:
    head = (
        "| engine | block size | steps | full-load steps | µs/step full load (mean / p50 / p99)"
        " | µs/step all | µs/generated token |\n|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['engine']} | {r['block_size']} | {r['steps']} | {r['full_load_steps']} | "
        f"{r['us_per_step_full_load_mean']:.1f} / {r['us_per_step_full_load_p50']:.1f} / "
        f"{r['us_per_step_full_load_p99']:.1f} | {r['us_per_step_mean']:.1f} | "
        f"{r['us_per_generated_token']:.3f} |\n"
        for r in rows
    )
    return head + body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5, help="runs of the workload, pooled")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--no-peer", action="store_true", help="skip the plain-Python peer")
    ap.add_argument("--previous", action="store_true", help="add the previous release's row")
    ap.add_argument("--previous-commit", default=None, help="default: previous_core.PREVIOUS")
    ap.add_argument("--core-dir", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--label", default=CORE, help=argparse.SUPPRESS)
    ap.add_argument("--rows-json", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rows_json:  # a child run of --previous: the core rows alone, as JSON
        rows = [
            run(
                args.requests,
                bs,
                args.label,
                args.max_num_batched_tokens,
                args.repeats,
                args.core_dir,
            )
            for bs in (16, 256)
        ]
        args.rows_json.write_text(json.dumps(rows))
        return
    rows = []
    for block_size in (16, 256):
        engines = [CORE] + ([] if args.no_peer else [PEER])
        for name in engines:
            rows.append(
                run(args.requests, block_size, name, args.max_num_batched_tokens, args.repeats)
            )
            print(f"  done: {name}, block size {block_size}", flush=True)
    if args.previous:
        rows += previous_rows(args)
    md = table(rows)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = (
        f"{cpu_model()}, {platform.machine()} ({os.cpu_count()} cores), "
        f"python {platform.python_version()}"
    )
    note = (
        f"# bench_core\n\n{args.requests} requests, prompt/output lengths uniform in [100, 1024], "
        f"seed 0, ignore_eos, prefix caching on, max_num_batched_tokens "
        f"{args.max_num_batched_tokens}, max_num_seqs {args.requests}. A step = schedule() + "
        f"reading the arrays a model runner reads ({', '.join(RUNNER_FIELDS)}; the core's "
        f"new_block_slots/indices/ids, the peer's dense block_tables) + update(). Full load: "
        f"{args.requests} requests running. {args.repeats} runs of the workload, pooled; steps "
        f"are per run.\n\nMachine: {machine}.\n\n{md}"
    )
    (args.out / "bench_core.md").write_text(note)
    (args.out / "bench_core.json").write_text(json.dumps(rows, indent=2))


def previous_rows(args: argparse.Namespace) -> list[dict]:
    """The previous release's core on the same workload, in a process of its own."""
    import previous_core

    commit = args.previous_commit or previous_core.PREVIOUS
    folder = previous_core.build(commit)
    out = folder / "bench_core_rows.json"
    command = [
        sys.executable, __file__, "--core-dir", str(folder), "--rows-json", str(out),
        "--label", f"{CORE}, previous release {commit}", "--requests", str(args.requests),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--repeats", str(args.repeats),
    ]  # fmt: skip
    subprocess.run(command, check=True)
    print(f"  done: previous release {commit}", flush=True)
    return json.loads(out.read_text())


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
