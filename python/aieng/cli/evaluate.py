"""`aieng eval`: perplexity of a model on a text file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from aieng.cli.common import engine_args, positive_int
from aieng.config.engine_args import EngineArgs


def add_eval(commands) -> None:
    p = commands.add_parser(
        "eval",
        help="perplexity of a model on a text file",
        description="Perplexity on a UTF-8 text file with a sliding window: each window scores "
        "only the tokens the previous one did not, token-weighted, through the engine's own "
        "forward pass.",
    )
    p.add_argument("text", metavar="FILE", help="the text to score")
    p.add_argument("--window", type=positive_int, metavar="N", help="default: the model context")
    p.add_argument("--stride", type=positive_int, metavar="N", help="default: half the window")
    p.add_argument("--max-tokens", type=positive_int, metavar="N", help="score only the start")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    EngineArgs.add_cli_args(p, only=("model", "device", "kv_cache_dtype", "tensor_parallel_size"))
    p.set_defaults(run=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    from aieng.benchmarks.evaluate import perplexity

    engine = engine_args(args)
    folder = Path(engine.model)
    result = perplexity(
        folder,
        args.text,
        window=args.window,
        stride=args.stride,
        max_tokens=args.max_tokens,
        device=None if engine.device == "auto" else engine.device,
        kv_cache_dtype=engine.kv_cache_dtype,
        tensor_parallel_size=engine.tensor_parallel_size,
    )
    if args.json:
        print(json.dumps({"model": str(folder), "file": args.text, **result.as_dict()}))
    else:
        print(
            f"{args.text}: {result.tokens:,} tokens scored (window {result.window}, stride "
            f"{result.stride}), perplexity {result.perplexity:.4f} "
            f"({result.nll:.4f} nats/token), {result.seconds:.1f} s"
        )
    return 0
