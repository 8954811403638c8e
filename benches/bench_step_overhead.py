"""Per-step time outside the model's forward at 256 running greedy requests (small model):
scheduling, input preparation, sampling and output processing, this tree against an earlier
design installed beside it (`--previous SITE`, e.g. built from the commit before a change with
`maturin build` and `pip install --no-deps --target SITE wheel`), in one run.

    .venv/bin/python benches/bench_step_overhead.py --previous /tmp/prev_site [--label NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_offline import build_checkpoint

from aieng.benchmarks.offline import machine

WORKER = Path(__file__).parent / "step_overhead_worker.py"


def run_worker(checkpoint: Path, site: str | None, requests: int, output_len: int) -> dict:
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, str(WORKER), str(checkpoint), "--requests", str(requests),
         "--output-len", str(output_len)], env=env, check=True,
        capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--previous", required=True, help="site folder holding the earlier aieng")
    ap.add_argument("--previous-name", default="previous design")
    ap.add_argument("--model", default="small", choices=("small", "base"))
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, _ = build_checkpoint(args.model, Path(tmp) / args.model)
        work = (args.requests, args.output_len)
        results = {
            args.previous_name: run_worker(checkpoint, args.previous, *work),
            "this design": run_worker(checkpoint, None, *work),
        }
    info = machine(2)
    before, after = results[args.previous_name], results["this design"]
    lines = [
        "# bench_step_overhead",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}, "
        f"Python {info['python']}, torch.set_num_threads(2).",
        "",
        f"{args.requests} greedy requests (prompts of 16-64 random tokens, {args.output_len} "
        f"output tokens, ignore_eos) on bench_offline's {args.model} random Llama (vocab 32000), "
        f"all admitted at once; medians over the steps that decode all {args.requests} requests. "
        "Outside the forward = the whole `LLMEngine.step()` less the model's forward and its "
        "LM head.",
        "",
        "| design | decode steps | step µs | forward µs | LM head µs "
        "| outside forward µs (p50 / mean) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['decode_steps']} | {r['step_us_p50']:.0f} | {r['forward_us_p50']:.0f} "
            f"| {r['logits_us_p50']:.0f} | {r['outside_forward_us_p50']:.0f} / "
            f"{r['outside_forward_us_mean']:.0f} |"
        )
    ratio = before["outside_forward_us_p50"] / after["outside_forward_us_p50"]
    lines += ["", f"Outside the forward: {ratio:.2f}x less time per step (p50).", ""]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "bench_step_overhead" + ("" if args.model == "small" else f"_{args.model}")
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps({"machine": info, "results": results}, indent=2))


if __name__ == "__main__":
    main()
