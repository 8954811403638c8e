"""The `aieng` command: generate, chat, train, eval, bench, serve, quantize, model.

Every subcommand reports a failure as one line on stderr (`aieng <cmd>: error: ...`) and a
non-zero exit status, never a traceback; `AIENG_DEBUG=1` shows the traceback as well.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from aieng.cli import bench, evaluate, generate, model, quantize, serve, train

COMMANDS = {
    "generate": generate.add_generate,
    "chat": generate.add_chat,
    "train": train.add_train,
    "eval": evaluate.add_eval,
    "bench": bench.add_bench,
    "serve": serve.add_serve,
    "quantize": quantize.add_quantize,
    "model": model.add_model,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aieng",
        description="aieng: an LLM inference engine with a Rust core. Without --model, "
        "commands use the bundled default model (a 5.9M-parameter Llama trained on the "
        "King James Bible; see MODEL_CARD.md).",
    )
    from aieng import __version__

    parser.add_argument("--version", action="version", version=f"aieng {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS.values():
        add(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        if os.environ.get("AIENG_DEBUG"):
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"aieng {args.command}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
