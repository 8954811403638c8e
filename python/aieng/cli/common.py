"""Options shared by the subcommands: the engine's (generated from EngineArgs) and number types."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from aieng.engine_args import EngineArgs, at_least, cli_type, fraction, in_range


def model_folder(args: argparse.Namespace) -> Path:
    from aieng.models.default import resolve_model

    folder = resolve_model(args.model)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face checkpoint")
    return folder


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine options given on the command line, with the model folder resolved."""
    return dataclasses.replace(EngineArgs.from_cli_args(args), model=str(model_folder(args)))


def load_llm(args: argparse.Namespace):
    from aieng import LLM

    return LLM(**dataclasses.asdict(engine_args(args)))


positive_int = cli_type(int, at_least(1))
non_negative_float = cli_type(float, at_least(0))
probability = cli_type(float, fraction)
port_number = cli_type(int, in_range(1, 65535))
