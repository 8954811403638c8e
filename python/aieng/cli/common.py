"""Options shared by the subcommands: the engine's (generated from EngineArgs) and number types."""

from __future__ import annotations

import argparse
import dataclasses

from aieng.config.cli_args import engine_args, model_folder
from aieng.config.engine_args import non_negative_float, port_number, positive_int, probability

__all__ = [
    "engine_args",
    "load_llm",
    "model_folder",
    "non_negative_float",
    "port_number",
    "positive_int",
    "probability",
]


def load_llm(args: argparse.Namespace):
    from aieng import LLM

    return LLM(**dataclasses.asdict(engine_args(args)))
