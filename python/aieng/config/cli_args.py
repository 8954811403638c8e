"""The engine options a command line gives, with the model folder resolved (the bundled model, a
name, or a path): shared by the `aieng` subcommands and `aieng serve`."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from aieng.config.engine_args import EngineArgs


def model_folder(args: argparse.Namespace) -> Path:
    from aieng.config.default_model import resolve_model

    folder = resolve_model(args.model)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face checkpoint")
    return folder


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine options given on the command line, with the model folder resolved."""
    return dataclasses.replace(EngineArgs.from_cli_args(args), model=str(model_folder(args)))
