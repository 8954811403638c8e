"""EngineArgs is the one definition of the engine's options: `LLM(...)`, `aieng serve` and
`aieng generate` take the same ones, with the same defaults and the same validation."""

import dataclasses
import os
import subprocess
import sys

import pytest

from aieng import LLM
from aieng import llm as llm_module
from aieng.cli import build_parser
from aieng.cli.generate import ENGINE_DEFAULTS as GENERATE_DEFAULTS
from aieng.config.default_model import default_model_path
from aieng.config.engine_args import DTYPES, EngineArgs, torch_dtype
from aieng.config.engine_config import create_engine_config

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
ENV.pop("AIENG_DEBUG", None)
FIELDS = set(EngineArgs.field_names())

BAD_VALUES = [
    ("block_size", 0),
    ("block_size", 12),
    ("block_size", 1 << 17),
    ("max_num_seqs", 0),
    ("max_num_seqs", True),
    ("max_num_batched_tokens", 0),
    ("max_model_len", 1),
    ("kv_cache_memory", 0),
    ("gpu_memory_utilization", 1.5),
    ("gpu_memory_utilization", 0),
    ("gpu_memory_utilization", float("nan")),
    ("dtype", "float8"),
    ("device", "tpu"),
    ("device", "cuda:x"),
    ("seed", -1),
    ("long_prefill_token_threshold", -1),
    ("enable_prefix_caching", "yes"),
    ("attention_backend", "flash"),
    ("kv_cache_dtype", "fp8"),
    ("model", 3),
]


def subcommand(name: str):
    parser = build_parser()
    [commands] = [a for a in parser._actions if a.dest == "command"]
    return commands.choices[name]


def engine_dests(parser) -> set[str]:
    [group] = [g for g in parser._action_groups if g.title == "engine options"]
    return {action.dest for action in group._group_actions}


def aieng(*args: str, module: str = "aieng"):
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60, env=ENV
    )


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "bench"])
def test_commands_take_every_engine_option(command):
    assert engine_dests(subcommand(command)) == FIELDS


def test_defaults_agree_between_library_and_commands(monkeypatch):
    serve = subcommand("serve").parse_args([])
    assert EngineArgs.from_cli_args(serve) == EngineArgs()
    # generate handles one prompt: it documents the one default it changes.
    assert GENERATE_DEFAULTS == {"max_num_seqs": 1}
    generate = subcommand("generate").parse_args(["a prompt"])
    assert EngineArgs.from_cli_args(generate) == EngineArgs(**GENERATE_DEFAULTS)

    built: list[EngineArgs] = []

    class Stop(Exception):
        pass

    def engine(args):
        built.append(args)
        raise Stop

    monkeypatch.setattr(llm_module, "LLMEngine", engine)
    with pytest.raises(Stop):
        LLM()
    assert built == [EngineArgs()]  # no model: create_engine_config chooses the bundled one
    assert create_engine_config(built[0]).model_path == str(default_model_path())
    with pytest.raises(Stop):
        LLM("some/folder", block_size=32, enable_prefix_caching=False)
    assert built[-1] == EngineArgs(model="some/folder", block_size=32, enable_prefix_caching=False)


def test_llm_refuses_unknown_keywords_and_documents_every_option():
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(max_num_sequences=4)
    with pytest.raises(TypeError):
        LLM("a", "b")  # only the model is positional
    for name in FIELDS - {"model"}:
        assert f"\n{name} (" in LLM.__init__.__doc__


@pytest.mark.parametrize(("name", "value"), BAD_VALUES)
def test_bad_values_raise_value_error_naming_the_field(name, value):
    with pytest.raises(ValueError, match=f"^{name} "):
        EngineArgs(**{name: value})
    if name != "model":
        with pytest.raises(ValueError, match=f"^{name} "):  # before any model is loaded
            LLM(str(default_model_path()), **{name: value})


def test_cross_field_checks():
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens .* max_num_seqs"):
        EngineArgs(max_num_seqs=8, max_num_batched_tokens=4)
    EngineArgs(max_num_seqs=8, max_num_batched_tokens=8)
    args = EngineArgs(max_model_len=1024)
    with pytest.raises(ValueError, match=r"^max_model_len 1024 exceeds"):
        args.effective_max_model_len(512)
    assert args.effective_max_model_len(4096) == 1024
    assert EngineArgs().effective_max_model_len(512) == 512


def test_effective_token_budget():
    assert EngineArgs().effective_max_num_batched_tokens(4096) == 2048
    assert EngineArgs(max_num_seqs=4096).effective_max_num_batched_tokens(4096) == 4096
    # never more than max_num_seqs full-length sequences, never less than max_num_seqs
    assert EngineArgs(max_num_seqs=1).effective_max_num_batched_tokens(512) == 512
    assert EngineArgs(max_num_seqs=2).effective_max_num_batched_tokens(2) == 4
    given = EngineArgs(max_num_seqs=4, max_num_batched_tokens=100)
    assert given.effective_max_num_batched_tokens(512) == 100


def test_paths_and_dtype_table():
    from pathlib import Path

    import torch

    from aieng.models.loader import resolve_dtype

    assert EngineArgs(model=Path("/some/folder")).model == "/some/folder"
    assert {torch_dtype(name) for name in DTYPES} == {torch.float32, torch.float16, torch.bfloat16}
    assert resolve_dtype("half") is torch.float16
    with pytest.raises(ValueError, match="float8"):
        resolve_dtype("float8")
    [dtype] = [a for a in subcommand("serve")._actions if a.dest == "dtype"]
    assert tuple(dtype.choices) == ("auto", *DTYPES)


@pytest.mark.parametrize(
    "args",
    [
        ("serve", "--block-size", "0"),
        ("serve", "--max-num-seqs", "0"),
        ("serve", "--port", "99999"),
        ("serve", "--port", "http"),
        ("serve", "--dtype", "float8"),
        ("serve", "--device", "tpu"),
        ("serve", "--gpu-memory-utilization", "1.5"),
        ("serve", "--max-queue-requests", "0"),
        ("serve", "--kv-cache-watermark", "2"),
        ("serve", "--request-timeout", "-1"),
        ("generate", "hi", "--block-size", "0"),
        ("generate", "hi", "--max-num-seqs", "0"),
        ("generate", "hi", "--device", "tpu"),
        ("eval", "x.txt", "--device", "tpu"),
    ],
)
def test_cli_bad_values_are_one_argparse_error(args):
    done = aieng(*args)
    flag = next(a for a in args if a.startswith("--"))
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"aieng {args[0]}: error: argument {flag}: "), done.stderr


def test_server_module_validates_the_same_flags():
    done = aieng("--port", "99999", module="aieng.server")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "argument --port: must be in [1, 65535], got 99999" in done.stderr
    done = aieng("--block-size", "3", module="aieng.server")
    assert done.returncode == 2 and "argument --block-size: must be a power of two" in done.stderr


def test_cross_field_error_on_the_command_line_is_one_line():
    done = aieng("generate", "hi", "--max-num-seqs", "8", "--max-num-batched-tokens", "4")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "aieng generate: error: max_num_batched_tokens must be at least max_num_seqs (8), so "
        "every running sequence can decode in a step, got 4"
    ]


def test_markdown_table_lists_every_option_once():
    table = EngineArgs.markdown_table().splitlines()
    assert len(table) == 2 + len(FIELDS)
    for f, row in zip(dataclasses.fields(EngineArgs), table[2:], strict=True):
        assert row.startswith(f"| `{f.name}` | `--{f.name.replace('_', '-')}`")


def test_help_lists_every_flag_without_importing_torch():
    code = (
        "import sys, aieng.cli, aieng.config.engine_args; "
        "sub = [a for a in aieng.cli.build_parser()._actions if a.dest == 'command'][0]; "
        "print(sub.choices['serve'].format_help()); "
        "assert 'torch' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert done.returncode == 0, done.stderr
    for name in FIELDS:
        assert "--" + name.replace("_", "-") in done.stdout
