"""`aieng bench`: the offline benchmark (aieng against HF transformers on the same checkpoint),
or with `--serve`, the load test against a running `aieng serve`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from aieng.cli.common import engine_args, positive_int
from aieng.config.engine_args import EngineArgs

# aieng's side of the workload: every request at once (as many as --requests' default), and no
# prefix caching, which random prompts cannot use.
ENGINE_DEFAULTS = {"max_num_seqs": 64, "enable_prefix_caching": False}


def add_bench(commands) -> None:
    p = commands.add_parser(
        "bench",
        help="benchmark aieng against HF transformers (or a server under load)",
        description="Offline benchmark: N requests (prompt and output lengths uniform in "
        "[16, 256], greedy, ignore_eos) through aieng's LLM.generate and through HF "
        "transformers' generate in static batches of 32, on the same checkpoint; prints "
        "throughput, latency percentiles and how many greedy outputs are identical. "
        "With --serve, runs the server load test (benches/load_test.py) instead; "
        "pass its options after --serve, e.g. `aieng bench --serve --url http://127.0.0.1:8000 "
        "--rate 2 --duration 60`.",
    )
    p.add_argument("--requests", type=positive_int, default=64, metavar="N", help="(64)")
    p.add_argument(
        "--max-len", type=positive_int, default=256, metavar="N",
        help="longest prompt and output (256); at most half the model context",
    )  # fmt: skip
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads (2)")
    p.add_argument("--skip-hf", action="store_true", help="run aieng alone")
    p.add_argument("--plot", metavar="FILE.png", help="draw throughput and latency")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument(
        "--serve", nargs=argparse.REMAINDER, metavar="...", help="run the server load test"
    )
    EngineArgs.add_cli_args(p, ENGINE_DEFAULTS)
    p.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    if args.serve is not None:
        try:
            from aieng.benchmarks.load_test import main as load_test
        except ImportError as err:
            raise RuntimeError(f"the load test is unavailable in this install: {err}") from err
        return int(load_test(args.serve) or 0)
    import torch

    from aieng.benchmarks import offline
    from aieng.config.model_config import ModelConfig

    torch.set_num_threads(args.threads)
    engine = engine_args(args)
    folder = Path(engine.model)
    config = ModelConfig.from_pretrained(folder)
    max_len = min(args.max_len, config.max_position_embeddings // 2)
    prompts, output_lens = offline.workload(args.requests, config.vocab_size, max_len)
    print(f"aieng bench: {args.requests} requests on {folder}", file=sys.stderr)
    runs = [offline.run_aieng(engine, prompts, output_lens)]
    if not args.skip_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("transformers is not installed: running aieng alone", file=sys.stderr)
        else:
            runs.append(offline.run_hf(folder, prompts, output_lens))
    info = offline.machine(args.threads)
    print(
        f"{args.requests} requests, prompt and output lengths uniform in [16, {max_len}], "
        f"greedy, ignore_eos; {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}, "
        f"{args.threads} threads"
    )
    print()
    print("| engine | output tok/s | wall s | latency p50 / p90 / p99 s | TTFT p50 / p99 s |")
    print("|---|---|---|---|---|")
    for run in runs:
        s = run.summary()
        ttft = f"{s['ttft_p50_s']:.2f} / {s['ttft_p99_s']:.2f}" if run.ttft_s else "-"
        print(
            f"| {run.engine} | {run.tokens_per_s:.1f} | {run.wall_s:.2f} | "
            f"{s['latency_p50_s']:.2f} / {s['latency_p90_s']:.2f} / {s['latency_p99_s']:.2f} | "
            f"{ttft} |"
        )
    spec = runs[0].spec_decode
    if spec and spec["draft_tokens"]:
        print(
            f"\nspeculative decoding: {spec['drafts']} drafts, {spec['draft_tokens']} draft "
            f"tokens, {spec['accepted_tokens']} accepted (acceptance "
            f"{spec['accepted_tokens'] / spec['draft_tokens']:.2f}, "
            f"{1 + spec['accepted_tokens'] / spec['drafts']:.2f} tokens per forward)"
        )
    result = {"model": str(folder), "machine": info, "runs": [r.summary() for r in runs]}
    if spec:
        result["spec_decode"] = spec
    if len(runs) == 2:
        same = offline.identical_requests(runs[0], runs[1])
        ratio = runs[0].tokens_per_s / runs[1].tokens_per_s
        result.update(ratio=ratio, greedy_identical_requests=same)
        print(f"\naieng / HF: {ratio:.2f}x; greedy outputs identical on {same}/{len(prompts)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        from aieng.benchmarks.plot import plot_offline

        plot_offline(runs, f"aieng bench on {folder.name} ({info['cpu']})", args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
