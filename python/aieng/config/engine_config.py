"""`EngineConfig`: the engine's options resolved once, from `EngineArgs` and the checkpoint.

`create_engine_config(args)` chooses the checkpoint (the bundled default model when `args.model`
is None: decided here only), reads its `config.json`, `generation_config.json` and
`tokenizer.json` once, resolves `device="auto"` (a CUDA device where one is present), the dtype
(`auto`: the checkpoint's on CUDA, float32 on CPU), the context length, the token budget of a
step, the end-of-sequence ids and the pooling of embedding requests, and returns a frozen
`EngineConfig`. Everything below the engine (executor, workers, runner, model loading,
kernels) reads that object: nothing there re-derives a value or re-reads a checkpoint file.
A tensor-parallel rank gets its own copy with `for_rank` (its rank, and on CUDA its device).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aieng.config.default_model import resolve_model
from aieng.config.engine_args import DTYPES, EngineArgs, checkpoint_dtype
from aieng.config.model_config import ModelConfig
from aieng.config.speculative import SpeculativeConfig, check_draft
from aieng.pooling import PoolingParams, sentence_transformers_pooling

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, element type, and its memory budget."""

    block_size: int
    kv_cache_dtype: str  # EngineArgs.kv_cache_dtype; the runner decides "auto" (kv_cache.py)
    kv_cache_memory: int | None  # bytes; None: sized by the runner (RAM or GPU profiling)
    gpu_memory_utilization: float
    enable_prefix_caching: bool


@dataclass(frozen=True)
class SchedulerConfig:
    """What the core's scheduler may put in one step and one sequence."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int
    shared_step_ms: float  # target of a step while clients share the engine; 0: never capped


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: the group's size, and which rank (and device index) this copy is."""

    tensor_parallel_size: int
    rank: int = 0
    local_rank: int = 0  # the rank's device index on its machine
    distributed_timeout_s: float = 600.0
    distributed_executor_backend: str = "mp"  # ranks 1..N-1: "mp" processes or "ray" actors


@dataclass(frozen=True)
class RunnerConfig:
    """The model runner's own options, as given: nothing to resolve in them."""

    attention_backend: str
    enforce_eager: bool
    seed: int
    cpu_quant_kernel: str
    cpu_lm_head: str
    cpu_native: str = "auto"


@dataclass(frozen=True)
class EngineConfig:
    """The resolved options: everything below the engine reads these, never `EngineArgs`."""

    model_path: str
    model: ModelConfig
    device: str  # "cpu", "cuda" or "cuda:N": never "auto"
    dtype: str  # a torch dtype name: "float32", "float16" or "bfloat16"
    eos_token_ids: tuple[int, ...]  # the tokenizer's and the checkpoint's, merged
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    runner: RunnerConfig
    max_logprobs: int  # the most logprobs a request may ask for
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    # Embeddings: the checkpoint's sentence-transformers pooling, else EngineArgs.pooling's
    # (None: a request must name one)
    pooling: PoolingParams | None = None

    @property
    def uses_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def for_rank(self, rank: int, local_rank: int) -> EngineConfig:
        """This config as tensor-parallel rank `rank` sees it: on CUDA, device cuda:local_rank."""
        parallel = dataclasses.replace(self.parallel, rank=rank, local_rank=local_rank)
        device = f"cuda:{local_rank}" if self.uses_cuda else self.device
        return dataclasses.replace(self, parallel=parallel, device=device)


def check_model_folder(args: EngineArgs) -> Path:
    """The checkpoint folder `args.model` names, or the bundled default model's when it names
    none (FileNotFoundError when there is no such folder)."""
    folder = resolve_model(args.model)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    return folder


def create_engine_config(args: EngineArgs, tokenizer: Any = None) -> EngineConfig:
    """Resolves `args` against the checkpoint it names (and this machine, for device='auto').
    `tokenizer`: the checkpoint's `aieng._core.Tokenizer` where the caller has loaded it (read
    for its end-of-sequence ids; without it, tokenizer.json is read where there is one).
    Raises ValueError or FileNotFoundError naming the problem."""
    folder = check_model_folder(args)
    model = ModelConfig.from_pretrained(folder)
    device = _resolve_device(args.device)
    dtype = _resolve_dtype(args.dtype, model, device, folder)
    if tokenizer is None and (folder / "tokenizer.json").is_file():
        from aieng._core import Tokenizer

        tokenizer = Tokenizer.from_dir(str(folder))
    # A runner alone (model tests, offline tools) may load a checkpoint without a tokenizer.
    eos = set(tokenizer.eos_token_ids if tokenizer is not None else ()) | set(model.eos_token_ids)
    outside = sorted(t for t in eos if t >= model.vocab_size)
    if outside:
        raise ValueError(
            f"{folder}: end-of-sequence token id {outside[0]} is outside the model's "
            f"vocabulary of {model.vocab_size} (tokenizer.json or generation_config.json)"
        )
    max_model_len = args.effective_max_model_len(model.max_position_embeddings)
    return EngineConfig(
        model_path=str(folder),
        model=model,
        device=device,
        dtype=dtype,
        eos_token_ids=tuple(sorted(eos)),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.effective_max_num_batched_tokens(max_model_len),
            max_model_len=max_model_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            shared_step_ms=args.shared_step_ms,
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            distributed_timeout_s=args.distributed_timeout_s,
            distributed_executor_backend=args.distributed_executor_backend,
        ),
        runner=RunnerConfig(
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            seed=args.seed,
            cpu_quant_kernel=args.cpu_quant_kernel,
            cpu_lm_head=args.cpu_lm_head,
            cpu_native=args.cpu_native,
        ),
        max_logprobs=args.max_logprobs,
        speculative=_speculative(args, folder),
        pooling=_pooling(args, folder),
    )


def _pooling(args: EngineArgs, folder: Path) -> PoolingParams | None:
    """The checkpoint's declared pooling (its sentence-transformers files), else the default
    `args.pooling` names (normalised), else None."""
    declared = sentence_transformers_pooling(folder)
    if declared is not None or args.pooling is None:
        return declared
    return PoolingParams(args.pooling)  # type: ignore[arg-type]


def _speculative(args: EngineArgs, folder: Path) -> SpeculativeConfig | None:
    """The checked speculative_config; a draft model must share the target's tokenizer and
    runs only without tensor parallelism."""
    if args.speculative_config is None:
        return None
    spec = SpeculativeConfig.from_dict(args.speculative_config)
    if spec.method == "draft_model" and spec.model is not None:
        if args.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config: a draft model runs only without tensor parallelism "
                f"(tensor_parallel_size {args.tensor_parallel_size}); use method 'ngram'"
            )
        check_draft(folder, spec.model)
    return spec


def _resolve_device(name: str) -> str:
    """'auto': a CUDA device where torch sees one, else the CPU; any other name as given."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_dtype(name: str, model: ModelConfig, device: str, folder: Path) -> str:
    """'auto': float32 on the CPU, the checkpoint's `torch_dtype` elsewhere."""
    if name != "auto":
        return DTYPES[name]
    if device.split(":")[0] == "cpu":
        return "float32"
    return checkpoint_dtype(model.dtype, str(folder / "config.json"))
