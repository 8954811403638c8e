"""Options shared by the subcommands that load a model."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="a Hugging Face checkpoint folder (default: the bundled default model)",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default: auto)")
    parser.add_argument(
        "--dtype", default="auto", help="float32, bfloat16, float16 or auto (default: auto)"
    )
    parser.add_argument(
        "--max-model-len", type=positive_int, metavar="N", help="cap on prompt + output tokens"
    )


def model_folder(args: argparse.Namespace) -> Path:
    from aieng.models.default import resolve_model

    folder = resolve_model(args.model)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face checkpoint")
    return folder


def load_llm(args: argparse.Namespace, **engine_options):
    from aieng import LLM

    return LLM(
        str(model_folder(args)),
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        **engine_options,
    )


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value
