"""`EngineClient`: what a front end (the server, its model versions, the CLI) may ask of an engine.

A front end talks to an engine only through this Protocol — generate, abort, stats, model
information, the tokenizer, health — never through its runner or its core, so the same front
end serves an engine in this process (`AsyncLLMEngine`) or one behind a process boundary (a
replica). `ModelInfo` is the engine's fixed description, built once when it is loaded;
`EngineStats` is what its loop publishes after every step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from aieng._core import Grammar, Tokenizer
from aieng.outputs import RequestOutput
from aieng.pooling import PoolingParams
from aieng.sampling import SamplingParams


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded engine serves, fixed for its lifetime."""

    model_path: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    device: str  # "cpu", "cuda:0", ...
    dtype: str  # the weights' torch dtype name
    kv_cache_dtype: str  # the cache's dtype as the runner resolved it: "int8", "bfloat16", ...
    block_size: int
    num_blocks: int
    max_num_seqs: int
    tensor_parallel_size: int
    max_num_batched_tokens: int = 0  # the token budget of one step (0: not known)
    # generation_config.json's sampling defaults, as SamplingParams fields
    generation_defaults: Mapping[str, Any] = field(default_factory=dict)
    load_phases: Mapping[str, float] = field(default_factory=dict)  # seconds per load phase
    # the compute paths chosen at load: attention_backend, linear_kernels, cpu_isa ('' off CPU)
    kernels: Mapping[str, str] = field(default_factory=dict)
    # Embeddings: the default pooling (the checkpoint's sentence-transformers files, else the
    # engine's `pooling` option; None: an embedding request must name one), the pooled
    # vector's size, and whether the model only embeds (an encoder).
    pooling: PoolingParams | None = None
    hidden_size: int = 0
    is_encoder: bool = False


@dataclass(frozen=True)
class EngineStats:
    """What the loop publishes after every step or command batch (read without locks)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    # the last step's token budget: max_num_batched_tokens, less when bounded in time because
    # several clients share the engine (EngineArgs.shared_step_ms)
    step_token_budget: int = 0
    num_requests: int = 0  # requests the engine holds (running, waiting or not yet in the core)
    kv_cache_dtype: str = ""  # ModelInfo.kv_cache_dtype; '' before the engine is loaded
    block_size: int = 0
    max_num_seqs: int = 0  # the batch's capacity in requests; 0 before the engine is loaded
    kernels: Mapping[str, str] = field(default_factory=dict)  # ModelInfo.kernels
    heartbeat: float = 0.0  # time.monotonic() of the loop's last turn
    # Speculative decoding (zero without it): verified drafts, their tokens, the tokens
    # accepted, and accepted tokens per draft position (vLLM's spec_decode figures).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()


@runtime_checkable
class EngineClient(Protocol):
    """An engine as a front end sees it."""

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def alive(self) -> bool: ...

    def not_running(self) -> str:
        """Why the engine does not serve, for an error message."""
        ...

    def generate(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        deadline: float | None = None,
        client: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's deltas up to its finished one (PoolingParams: one output, finished,
        with its `embedding`). `client` names who sent it, for fair shares of the engine's
        prefill budget (None: one anonymous client)."""
        ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> None: ...

    def compile_grammar(self, params: SamplingParams) -> Grammar | None:
        """The compiled constraint of params (thread-safe; InvalidArgumentError if invalid)."""
        ...

    def gpu_memory(self) -> Any:
        """The engine's GPU memory figures now (`aieng.worker.gpu_memory.GpuMemory`); None off
        CUDA."""
        ...

    def start(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops serving, then releases the engine: its workers, KV cache and threads (waiting
        at most `timeout` seconds for a running step). Idempotent."""
        ...
