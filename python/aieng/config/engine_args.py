"""`EngineArgs`: the one definition of every engine option, with vLLM's names.

`LLM(...)`, `aieng serve`, `aieng generate` and the other commands take their options, defaults,
validation and help text from the fields below; the CLI flags are generated from them
(`add_cli_args`), and so is the options table of docs/usage.md (`markdown_table`, written there
by scripts/gen_docs_tables.py). Derived values (the context length, the token budget of a step)
are computed here and nowhere else.

Importing this module does not import torch, so `aieng --help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from aieng.config import speculative as spec_config
from aieng.pooling import POOLING_METHODS

# A dtype name as config.json and the --dtype flag spell it -> the torch attribute.
DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# Target of a step while clients share the engine (docs/server.md, "Fair shares"): about the
# bundled model's step for a short chat prompt on a 2-core CPU, so a light client's first token
# waits for a step no longer than its own.
DEFAULT_SHARED_STEP_MS = 10.0
MAX_BLOCK_SIZE = 1 << 16  # the Rust core's limit (BlockPool::new)
ATTENTION_BACKENDS = ("auto", "torch", "cuda", "cpu")
FLOAT_KV_CACHE_DTYPES = ("float32", "bfloat16")  # a cache in this dtype whatever the model's
KV_CACHE_DTYPES = ("auto", "int8", *FLOAT_KV_CACHE_DTYPES)
CPU_QUANT_KERNELS = ("auto", "int8", "int8x2", "int4pack", "dequant")
CPU_LM_HEADS = ("dense", "int8")
CPU_NATIVE_MODES = ("auto", "off")

Check = Callable[[Any], str | None]  # -> why the value is refused, or None


def torch_dtype(name: str):
    """The torch dtype `name` stands for (a key of DTYPES; KeyError otherwise)."""
    import torch

    return getattr(torch, DTYPES[name])


def checkpoint_dtype(name: str, source: str = "config.json") -> str:
    """A checkpoint's `torch_dtype` as a DTYPES value; ValueError naming the field otherwise."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"{source}: field 'torch_dtype' = {name!r} is not supported") from None


def at_least(minimum: float) -> Check:
    return lambda value: None if value >= minimum else f"must be at least {minimum}"


def in_range(low: int, high: int) -> Check:
    return lambda value: None if low <= value <= high else f"must be in [{low}, {high}]"


def fraction(value: float) -> str | None:
    return None if 0 < value <= 1 else "must be in (0, 1]"


def finite_at_least_0(value: float) -> str | None:
    return None if 0 <= value < math.inf else "must be a finite number >= 0"


def positive(value: float) -> str | None:
    return None if value > 0 else "must be positive"


def _block_size(value: int) -> str | None:
    if 1 <= value <= MAX_BLOCK_SIZE and value & (value - 1) == 0:
        return None
    return f"must be a power of two in [1, {MAX_BLOCK_SIZE}]"


def _device(value: str) -> str | None:
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        return None
    return "must be 'auto', 'cpu', 'cuda' or 'cuda:N'"


def _seed(value: int) -> str | None:
    return None if 0 <= value < 2**64 else "must be in [0, 2**64)"


def cli_type(kind: type, check: Check | None = None) -> Callable[[str], Any]:
    """An argparse `type`: parses the text as `kind`, then applies `check`; a refused value
    becomes argparse's one-line error naming the flag."""

    def parse(text: str):
        try:
            value = spec_config.parse_json(text) if kind is dict else kind(text)
        except ValueError as error:
            if kind is dict:
                raise argparse.ArgumentTypeError(str(error)) from None
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        reason = check(value) if check else None
        if reason is None and isinstance(value, float) and not math.isfinite(value):
            reason = "must be a finite number"
        if reason:
            raise argparse.ArgumentTypeError(f"{reason}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def option(
    default: Any,
    help: str,
    *,
    default_text: str | None = None,
    check: Check | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
) -> Any:
    """A field of EngineArgs: its default (`default_text` says what a None default means),
    help text and validation."""
    meta = {
        "help": help,
        "default_text": default_text,
        "check": check,
        "choices": choices,
        "metavar": metavar,
    }
    return field(default=default, metadata=meta)


@dataclass
class EngineArgs:
    """Every option of the engine. Invalid values raise ValueError naming the field."""

    model: str | None = option(
        None,
        "a Hugging Face checkpoint folder",
        default_text="the bundled default model",
        metavar="PATH",
    )
    dtype: str = option(
        "auto",
        "dtype of the weights (and of the KV cache unless kv_cache_dtype says otherwise); auto: "
        "the checkpoint's (float32 on CPU)",
        choices=("auto", *DTYPES),
    )
    device: str = option(
        "auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N", check=_device
    )
    max_model_len: int | None = option(
        None,
        "most tokens of one sequence, prompt and output",
        default_text="the model's context (max_position_embeddings)",
        check=at_least(2),
        metavar="N",
    )
    max_num_seqs: int = option(256, "most sequences in one step", check=at_least(1), metavar="N")
    max_num_batched_tokens: int | None = option(
        None,
        "most tokens in one step, and the size of the profiling step that measures the GPU "
        "memory left for the KV cache",
        default_text=f"max({DEFAULT_MAX_NUM_BATCHED_TOKENS}, max_num_seqs), at most "
        "max_num_seqs * max_model_len",
        check=at_least(1),
        metavar="N",
    )
    block_size: int = option(
        16, "tokens per KV cache block, a power of two", check=_block_size, metavar="N"
    )
    kv_cache_dtype: str = option(
        "auto",
        "element type of the KV cache; auto: bfloat16 where the native CPU decoder (cpu_native) "
        "serves a float32 model (half a float32 cache's bytes, so twice the blocks per budget and "
        "half the bytes read per decode step), else the model's dtype; float32, bfloat16: K and "
        "V in that dtype whatever the model's (a dtype other than the model's is read by the "
        "native CPU decoder only; float32 keeps a float32 model's greedy tokens those of "
        "transformers); int8: K and V quantized symmetrically per token and KV head with a scale "
        "in the model's dtype, so a budget holds about 1.9x the blocks of float16 or 3.8x of "
        "float32 (head_dim 64)",
        choices=KV_CACHE_DTYPES,
    )
    kv_cache_memory: int | None = option(
        None,
        "bytes for the KV cache",
        default_text="on CUDA what gpu_memory_utilization leaves after the profiling step, on "
        "CPU 20% of the available RAM; at most what max_num_seqs full-length sequences use",
        check=at_least(1),
        metavar="BYTES",
    )
    gpu_memory_utilization: float = option(
        0.9,
        "fraction of the GPU's memory the engine may use, in (0, 1]",
        check=fraction,
        metavar="F",
    )
    enable_prefix_caching: bool = option(
        True, "reuse the KV blocks of a prompt prefix computed before"
    )
    seed: int = option(
        0,
        "seed of the sampling of the requests that bring no seed of their own",
        check=_seed,
        metavar="N",
    )
    max_logprobs: int = option(
        20,
        "most logprobs and prompt_logprobs one request may ask for (vLLM's max_logprobs); -1: "
        "the whole vocabulary",
        check=at_least(-1),
        metavar="N",
    )
    long_prefill_token_threshold: int = option(
        0,
        "largest prefill chunk of one request in a step; 0: no limit but the step's",
        check=at_least(0),
        metavar="N",
    )
    shared_step_ms: float = option(
        DEFAULT_SHARED_STEP_MS,
        "while several clients have requests in the engine (and for 1 s after), the prefill "
        "tokens of a step are capped so its duration, predicted by a cost model learnt from "
        "the engine's own steps, stays under this many milliseconds (a light client's request "
        "then waits for a short step, not a full one); 0: never capped. One client alone (the "
        "library) always gets the full budget",
        check=finite_at_least_0,
        metavar="MS",
    )
    attention_backend: str = option(
        "auto",
        "attention implementation; auto: the best for the device (the CUDA kernels on an NVIDIA "
        "GPU in float16/bfloat16, the Rust core's kernel on the CPU in float32 or bfloat16 (a "
        "float or INT8 cache), each once it "
        "passes its start-up check); cuda, cpu: those kernels; torch: the paged reference, on "
        "any device",
        choices=ATTENTION_BACKENDS,
    )
    cpu_quant_kernel: str = option(
        "auto",
        "kernel of INT4/INT8-quantized layers on the CPU; int8: activations quantized to int8 per "
        "block of 32 and multiplied on the CPU's int8 dot-product instructions (W4A8, W8A8); "
        "int8x2: the same with a second int8 term per activation (about 15 bits: bfloat16's "
        "accuracy or better, two dot products per weight); int4pack: torch's INT4 kernel with "
        "bfloat16 activations (W4A16, 4-bit layers); dequant: the float32 reference; auto: the "
        "first of int8, int8x2, int4pack that passes its check at load (int8 is the fastest, "
        "and within +0.5% of int8x2's perplexity)",
        choices=CPU_QUANT_KERNELS,
    )
    cpu_lm_head: str = option(
        "dense",
        "how the CPU computes the logits; dense: the float LM head (tied or not), through "
        "aieng's dense GEMV for decode batches; int8: an 8-bit copy of the head (symmetric, one "
        "scale per 32 weights: 1.125 bytes a weight, against float32's 4) on the int8 kernels, "
        "the embedding lookup keeping the float rows",
        choices=CPU_LM_HEADS,
    )
    pooling: str | None = option(
        None,
        "how an embedding request pools a checkpoint that declares no pooling (no "
        "sentence-transformers modules.json), normalised to unit length; a checkpoint's own "
        "declaration and a request's `pooling` come first",
        default_text="none: such a request must name its pooling",
        choices=POOLING_METHODS,
    )
    cpu_native: str = option(
        "auto",
        "the native CPU decoder: one Rust call runs a step's whole forward (every layer, the "
        "kernels on one thread pool, the GIL released); auto: on for the CPU where the model is "
        "covered (dense Llama/Qwen/Gemma-style decoders in float32 or bfloat16, their INT4/INT8 "
        "layers on the int8 kernels, with the cpu attention backend), else the torch runner with "
        "one log line naming why; off: always the torch runner",
        choices=CPU_NATIVE_MODES,
    )
    speculative_config: dict | None = option(  # noqa: RUF009 (None default)
        None,
        "speculative decoding, as vLLM's dictionary (JSON on the command line): "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}, or a draft model sharing the tokenizer: {"model": '
        '"path/to/draft", "num_speculative_tokens": 4} ("default-draft", or the flag\'s word '
        "`draft`: the draft shipped with the default model); optional "
        '"disable_by_batch_size": no drafts in a step with more running requests than that '
        "(0: always; unset: the limit measured for the device, 8 on the CPU). "
        "The output is exactly plain decoding's",
        default_text="off",
        check=spec_config.refusal,
        metavar="JSON",
    )
    enforce_eager: bool = option(
        False,
        "run every step eagerly, without CUDA graphs (which replay decode steps of 1, 2, 4, 8, "
        "16, 32, ... up to max_num_seqs rows, with the `cuda` attention backend once per context "
        "bucket of 1024, 2048, ... positions up to max_model_len where its split-K plan differs, "
        "the smallest holding the step's longest context replayed); no effect on CPU",
    )

    tensor_parallel_size: int = option(
        1,
        "ranks the model is split over (torch.distributed: NCCL on GPUs, gloo on CPUs); the "
        "engine's process is rank 0 and starts the others on this machine, unless a launcher "
        "(torchrun) started every rank (RANK, WORLD_SIZE in the environment)",
        check=at_least(1),
        metavar="N",
    )
    distributed_timeout_s: float = option(
        60.0,
        "seconds a tensor-parallel collective may wait for a rank; past it the rank is taken as "
        "hung and the engine stops",
        check=positive,
        metavar="S",
    )
    distributed_executor_backend: str = option(
        "mp",
        "how the tensor-parallel ranks 1..N-1 run: mp, processes this machine spawns (or a "
        "launcher's); ray, Ray actors in a placement group, on any node of the Ray cluster "
        "(pip install 'aieng[ray]'; RAY_ADDRESS or a local cluster)",
        choices=("mp", "ray"),
    )

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        kinds = _field_kinds()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind, optional = kinds[f.name]
            if value is None and optional:
                continue
            if not _is_instance(value, kind):
                raise ValueError(f"{f.name} must be {_KIND_NAMES[kind]}, got {value!r}")
            reason = _refusal(f, value)
            if reason:
                raise ValueError(f"{f.name} {reason}, got {value!r}")
        if (
            self.max_num_batched_tokens is not None
            and self.max_num_batched_tokens < self.max_num_seqs
        ):
            raise ValueError(
                f"max_num_batched_tokens must be at least max_num_seqs ({self.max_num_seqs}), so "
                f"every running sequence can decode in a step, got {self.max_num_batched_tokens}"
            )

    # ------------------------------------------------------------------ derived values

    def effective_max_model_len(self, model_context: int) -> int:
        """max_model_len, or the model's context (its max_position_embeddings) when not given."""
        if self.max_model_len is None:
            return model_context
        if self.max_model_len > model_context:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context "
                f"(max_position_embeddings) of {model_context}"
            )
        return self.max_model_len

    def effective_max_num_batched_tokens(self, max_model_len: int) -> int:
        """The token budget of one step, which the core schedules and the runner profiles:
        max_num_batched_tokens, or vLLM's default with chunked prefill, max(2048,
        max_num_seqs), never more than max_num_seqs full-length sequences."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        default = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)
        return min(default, self.max_num_seqs * max_model_len)

    # ------------------------------------------------------------------ the CLI and the docs

    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser,
        defaults: Mapping[str, Any] | None = None,
        only: Collection[str] | None = None,
    ) -> argparse._ArgumentGroup:
        """Adds a flag per field (`--max-num-seqs`, ...) in an "engine options" group.
        `defaults` replaces some fields' defaults for one command; `only` keeps some fields,
        for a command that uses no more of the engine."""
        defaults = defaults or {}
        unknown = (set(defaults) | set(only or ())) - set(cls.field_names())
        if unknown:
            raise ValueError(f"not engine options: {sorted(unknown)}")
        kinds = _field_kinds()
        group = parser.add_argument_group("engine options")
        for f in dataclasses.fields(cls):
            if only is not None and f.name not in only:
                continue
            flag = _flag(f.name)
            default = defaults.get(f.name, f.default)
            given_text = f.metadata["default_text"]
            if f.name in defaults or given_text is None:
                default_text = "%(default)s"
            else:
                default_text = given_text.replace("%", "%%")
            help_text = f"{f.metadata['help'].replace('%', '%%')} (default: {default_text})"
            kind, _ = kinds[f.name]
            if kind is bool:
                action = group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=default
                )
                action.help = help_text  # some Pythons append the default themselves
                continue
            group.add_argument(
                flag,
                type=cli_type(kind, f.metadata["check"]),
                default=default,
                choices=f.metadata["choices"],
                metavar=f.metadata["metavar"],
                help=help_text,
            )
        return group

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """EngineArgs from the parsed flags (fields without a flag keep their defaults)."""
        given = {name: getattr(args, name) for name in cls.field_names() if hasattr(args, name)}
        return cls(**given)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def docstring(cls) -> str:
        """One paragraph per option, for the docstrings of the functions that take them."""
        kinds = _field_kinds()
        return "\n".join(
            f"{f.name} ({_KIND_NAMES[kinds[f.name][0]]}; default: {_default_text(f)}): "
            f"{_meaning(f)}."
            for f in dataclasses.fields(cls)
        )

    @classmethod
    def markdown_table(cls) -> str:
        """The options table of docs/usage.md: `LLM(...)` keyword, flag, default, meaning."""
        rows = ["| `LLM(...)` keyword | flag | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            flag = f"`{_flag(f.name)}`"
            if _field_kinds()[f.name][0] is bool:
                flag += f", `--no-{_flag(f.name)[2:]}`"
            default = f.metadata["default_text"] or f"`{f.default!r}`"
            rows.append(f"| `{f.name}` | {flag} | {default} | {_meaning(f)} |")
        return "\n".join(rows)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default_text(f: dataclasses.Field) -> str:
    return f.metadata["default_text"] or repr(f.default)


def _meaning(f: dataclasses.Field) -> str:
    choices = f.metadata["choices"]
    return f"{f.metadata['help']} (one of {', '.join(choices)})" if choices else f.metadata["help"]


_KIND_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "True or False",
    dict: "a JSON object",
}


@functools.cache
def _field_kinds() -> dict[str, tuple[type, bool]]:
    """field name -> (its type without None, whether None is allowed)."""
    kinds = {}
    for name, hint in typing.get_type_hints(EngineArgs).items():
        args = typing.get_args(hint)
        optional = type(None) in args
        kinds[name] = (next(a for a in args if a is not type(None)) if optional else hint, optional)
    return kinds


def _is_instance(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind)


def _refusal(f: dataclasses.Field, value: Any) -> str | None:
    choices = f.metadata["choices"]
    if choices and value not in choices:
        return f"must be one of {', '.join(choices)}"
    check = f.metadata["check"]
    return check(value) if check else None


# Number types of command-line flags (argparse `type=`), with the checks' messages.
positive_int = cli_type(int, at_least(1))
non_negative_float = cli_type(float, at_least(0))
probability = cli_type(float, fraction)
port_number = cli_type(int, in_range(1, 65535))
