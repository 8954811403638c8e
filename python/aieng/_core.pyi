# Type stubs of the Rust extension module `aieng._core` (kept true by tests/test_stubs.py).
import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, final

import numpy as np
import numpy.typing as npt

__version__: str

_Tokens = Sequence[int] | npt.NDArray[np.integer[Any]]
_I32 = npt.NDArray[np.int32]
_I64 = npt.NDArray[np.int64]

class AiengError(Exception): ...
class InvalidArgumentError(AiengError, ValueError): ...
class RequestTooLargeError(InvalidArgumentError): ...
class OutOfBlocksError(AiengError, RuntimeError): ...
class UnknownRequestError(AiengError, KeyError): ...
class EngineStateError(AiengError, RuntimeError): ...
class TokenizerError(AiengError, ValueError): ...
class ChatTemplateError(AiengError, ValueError): ...

@final
class Tokenizer:
    @staticmethod
    def from_file(path: str | os.PathLike[str]) -> Tokenizer: ...
    @staticmethod
    def from_dir(path: str | os.PathLike[str]) -> Tokenizer: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]: ...
    def decode(self, token_ids: _Tokens, skip_special_tokens: bool = True) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> list[int]: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def bos_token(self) -> str | None: ...
    @property
    def eos_token(self) -> str | None: ...
    @property
    def add_bos_token(self) -> bool | None: ...
    @property
    def chat_template(self) -> str | None: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, token_id: int) -> str | None: ...
    def is_special(self, token_id: int) -> bool: ...
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str: ...

@final
class BlockPool:
    def __new__(
        cls, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> BlockPool: ...
    def allocate(self, token_ids: _Tokens) -> BlockTable: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def usage(self) -> float: ...
    def stats(self) -> dict[str, Any]: ...
    def check_invariants(self) -> None: ...

@final
class BlockTable:
    @property
    def block_ids(self) -> list[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def released(self) -> bool: ...
    def append(self, token_ids: _Tokens) -> None: ...
    def commit(self, num_computed: int | None = None) -> None: ...
    def release(self) -> None: ...
    def __enter__(self) -> BlockTable: ...
    def __exit__(
        self,
        *_args: type[BaseException] | BaseException | TracebackType | None,
    ) -> bool: ...
    def __len__(self) -> int: ...

@final
class PlanBuffer:
    """The columns under a StepPlan's arrays (their `base`); opaque."""

@final
class StepPlan:
    """The work of one step as flat int32 arrays. Rows are requests (R of them), tokens are
    laid out request after request (T), S rows sample a token.

    Block tables are handed over as changes: a runner keeps one persistent table per slot,
    (number of slots, ceil(max_model_len / block_size)), and applies
    `table[new_block_slots, new_block_indices] = new_block_ids` each step. Every block of a
    freshly opened table (admission, readmission after preemption, prefix-cache hits
    included) is reported from index 0, and a block added as a request grows is reported
    once; the first ceil(seq_lens[r] / block_size) entries of `table[slots[r]]` are then row
    r's block ids. Waiting requests hold slots too, so slot numbers can exceed max_num_seqs.

    Every array is a view of the core's own column, held by the step's `PlanBuffer` (the
    `base` of each; no copy), made when first read and the same object after; a view keeps the
    buffer alive. A dropped plan's buffer and views are planned into again by a later step only
    while nothing else refers to them (nor to a slice of them): an array still held never
    changes.
    """

    @property
    def num_requests(self) -> int:
        """R."""
    @property
    def num_tokens(self) -> int:
        """T."""
    @property
    def input_ids(self) -> _I32:
        """(T,) the tokens to run."""
    @property
    def positions(self) -> _I32:
        """(T,) their positions in their sequences."""
    @property
    def slot_mapping(self) -> _I32:
        """(T,) the KV cache slot of each token: block id * block_size + offset."""
    @property
    def query_start_loc(self) -> _I32:
        """(R + 1,) row r's tokens are input_ids[query_start_loc[r]:query_start_loc[r + 1]]."""
    @property
    def num_computed_tokens(self) -> _I32:
        """(R,) tokens of each row already in the cache before this step."""
    @property
    def seq_lens(self) -> _I32:
        """(R,) context length of each row after this step."""
    @property
    def logits_indices(self) -> _I32:
        """(S,) the token rows whose logits are sampled."""
    @property
    def sample_request_rows(self) -> _I32:
        """(S,) the request row of each sample."""
    @property
    def slots(self) -> _I32:
        """(R,) each row's persistent slot, stable while its request lives (then reused)."""
    @property
    def new_block_slots(self) -> _I32:
        """(N,) the slot of each block new to that slot's table since it was last reported."""
    @property
    def new_block_indices(self) -> _I32:
        """(N,) its position in that slot's block table."""
    @property
    def new_block_ids(self) -> _I32:
        """(N,) its block id."""
    @property
    def banned_rows(self) -> _I32:
        """(K,) sampling row i (an index into logits_indices) may not draw banned_ids[i]: the
        EOS (unless ignore_eos) and stop ids of a request that has not produced min_tokens."""
    @property
    def banned_ids(self) -> _I32:
        """(K,) the banned token of each entry of banned_rows."""
    @property
    def request_ids(self) -> list[str]:
        """(R,) each row's request id; built when read."""
    def grammar_bitmask(self) -> tuple[_I64, _I32] | None:
        """The token masks of the sampling rows with a structured-output grammar, computed on
        a worker thread since schedule() and waited for here (without the GIL): rows (M,)
        (indices into logits_indices) and a bitmask (M, ceil(vocab / 32)) in which token t is
        allowed when bit t % 32 of word t / 32 is set. None when no row has a grammar."""
    def __len__(self) -> int: ...

@final
class FinishedRequest:
    @property
    def request_id(self) -> str: ...
    @property
    def slot(self) -> int: ...
    @property
    def finish_reason(self) -> str: ...
    @property
    def stop_reason(self) -> int | str | None: ...
    @property
    def num_output_tokens(self) -> int: ...

@final
class StepOutputs:
    """What update() changed: one entry per token appended, in plan order (a row that took
    several tokens repeats). Each field is built when first read."""

    @property
    def rows(self) -> _I32:
        """The plan row of each appended token."""
    @property
    def slots(self) -> _I32:
        """Its slot."""
    @property
    def token_ids(self) -> _I64:
        """The tokens, as appended."""
    @property
    def texts(self) -> list[str]:
        """The text each token adds (after stop-string hold-back); empty without a tokenizer."""
    @property
    def finished(self) -> list[FinishedRequest]:
        """Requests that finished in this update, in plan order."""

@final
class EngineCore:
    def __new__(
        cls,
        num_blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 4096,
        enable_prefix_caching: bool = True,
        long_prefill_token_threshold: int = 0,
        tokenizer: Tokenizer | None = None,
        shared_step_ms: float = 0.0,
    ) -> EngineCore: ...
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: _Tokens,
        *,
        max_tokens: int = 16,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        eos_token_ids: _Tokens | None = None,
        stop_token_ids: _Tokens | None = None,
        priority: int = 0,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        grammar: Grammar | None = None,
        skip_prefix_cache: bool = False,
        client: str | None = None,
    ) -> int:
        """Queues a request and returns its slot. With `grammar`, the request gets a matcher of
        its own: its sampling rows get masks, every token advances it, and a complete grammar
        ends the request (finish reason "stop"). With `skip_prefix_cache`, the request reads no
        cached prefix (it computes every prompt token, e.g. to score them); its own blocks are
        still cached for others. `client` names who sent it: while several clients have
        requests, each step's prefill budget is split fairly between them (None: one client)."""
    def abort(self, request_id: str) -> FinishedRequest: ...
    def schedule(self) -> StepPlan: ...
    def update(self, sampled: _Tokens, num_sampled: _Tokens | None = None) -> StepOutputs:
        """Applies the step in flight. `sampled` is the flat array of accepted tokens (a
        contiguous int64 array is read in place, without a copy);
        `num_sampled[i]` (>= 1, default 1 each) of them belong to the i-th sampling row, in
        order. Each token goes through every stop check; once a request stops, the rest of
        its tokens are dropped. Tokens past a row's first are computed in the next step."""
    def set_draft(self, request_id: str, token_ids: _Tokens) -> None:
        """Sets the draft tokens that follow the request's tokens now (speculative decoding),
        replacing any it had. The next step that decodes it runs them after its last token,
        every position sampling (logits_indices holds 1 + drafts rows for it, in order, with
        the min_tokens bans of each position); update() counts as computed only the drafts
        its tokens confirm and releases the blocks that held only rejected positions. Drafts
        are capped by the request's length limit and the step's token budget; a request with
        a grammar takes none."""
    def has_unfinished(self) -> bool: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def step_token_budget(self) -> int: ...
    @property
    def block_pool(self) -> BlockPool: ...
    def request_token_ids(self, request_id: str) -> list[int]: ...
    def block_ids(self, request_id: str) -> list[int]:
        """The KV blocks a live request holds now, in order; empty while it waits."""
    def num_cached_tokens(self, request_id: str) -> int | None: ...
    def stats(self) -> dict[str, Any]: ...
    def check_invariants(self) -> None: ...

@final
class GrammarCompiler:
    """Compiles structured-output constraints (llguidance) over a tokenizer's vocabulary, for
    a model whose logits are `vocab_size` wide; compiled constraints are cached."""

    def __new__(cls, tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler: ...
    def compile(self, kind: str, source: str = "") -> Grammar:
        """kind: json (source: a JSON schema's text), json_object, regex, choice (source: a JSON
        list of strings) or grammar (Lark). Raises InvalidArgumentError naming the problem."""
    @property
    def vocab_size(self) -> int: ...

@final
class Grammar:
    """A compiled constraint; each request added with it gets a matcher of its own."""

    @property
    def kind(self) -> str: ...
    def allowed_first(self, token_ids: _Tokens, stop_ids: _Tokens) -> list[int]:
        """Of `token_ids`, those the grammar allows as a request's first output token;
        `stop_ids` (its EOS and stop ids) are allowed if the grammar may end at its start."""

_U8 = npt.NDArray[np.uint8]
_F32 = npt.NDArray[np.float32]

def oversize_text(body: bytes, field: str, limit: int) -> tuple[str | None, int | None, int] | None:
    """(model, index, size) of the first text of the JSON object `body`'s top-level `field` (a
    string or a list of strings) past `limit` UTF-8 bytes, parsed with the GIL released; None
    when there is none or the body is not strict JSON (index: None for a lone text)."""

def cpu_isa() -> str:
    """The instruction set the CPU kernels use (detected, or lowered by AIENG_CPU_ISA)."""

def cpu_isa_paths() -> list[str]:
    """Every instruction-set path this CPU can run, lowest first."""

@final
class Int8Weights:
    """A 4- or 8-bit weight repacked for the int8 dot-product kernels."""

    def __new__(cls, q: _U8, scales: _F32, zeros: _F32, bits: int) -> Int8Weights: ...
    @property
    def out_features(self) -> int: ...
    @property
    def in_features(self) -> int: ...
    @property
    def bits(self) -> int: ...
    @property
    def group_size(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def matmul(
        self, x: _F32, out: _F32, threads: int, isa: str | None = None, split: bool = False
    ) -> None: ...
    def dequantize(self) -> _F32: ...

def dense_gemv(
    x: _F32,
    w: _F32 | npt.NDArray[np.int16],
    out: _F32,
    threads: int,
    isa: str | None = None,
) -> None:
    """out (M, N) = x (M, K) @ W^T for M <= 8; W float32, or bfloat16 bits as int16."""

def paged_attention(
    q: _F32,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    out: _F32,
    query_start_loc: _I32,
    seq_lens: _I32,
    block_tables: _I32,
    scale: float,
    window: int,
    softcap: float,
    threads: int,
    isa: str | None = None,
    k_scale: np.ndarray | None = None,
    v_scale: np.ndarray | None = None,
) -> None:
    """out (T, H, D) float32 = attention of q over the paged K/V caches, read in place: float32,
    bfloat16 (as uint16 bits) or int8 with k_scale/v_scale (float32 or bfloat16 bits)."""

def cpu_pool_stats() -> tuple[int, int, int]:
    """(calls, blocks, backoffs) of the CPU kernels' thread pools since the process started:
    calls handed to workers, times a worker blocked (to be woken by a later call), times a
    worker found its core contended and stopped watching for a while. Monotonic."""

def int8_peak_ops(threads: int, iterations: int = 20_000_000) -> float | None:
    """Int8 operations per second of independent vpdpbusd chains (None without AVX-512 VNNI)."""

def rms_norm(
    x: _F32,
    weight: _F32,
    eps: float,
    out: _F32,
    threads: int,
    branch: _F32 | None = None,
) -> None:
    """out (T, H) = weight * x / sqrt(mean(x^2) + eps) per row of x (T, H) float32; with
    branch (T, H), x += branch first, in place."""

def silu_and_mul(x: _F32, out: _F32, threads: int) -> None:
    """out (T, I) = silu(gate) * up for x (T, 2I) = [gate | up], float32."""

def rotary(x: _F32, cos: _F32, sin: _F32, out: _F32, threads: int) -> None:
    """out (T, H, D) contiguous = rotate-half RoPE of x (T, H, D) float32 (strided rows allowed,
    each head contiguous) with cos and sin (T, D/2)."""

def kv_write(
    k: _F32,
    v: _F32,
    slots: npt.NDArray[np.int64],
    k_cache: np.ndarray,
    v_cache: np.ndarray,
) -> None:
    """k, v (T, H_kv, D) float32 into slot slots[t] of the caches (blocks, block_size, H_kv, D):
    both float32 or both bfloat16 as uint16 bits."""

# A linear layer as the native decoder takes it: (weight, bias or None, split), the weight
# float32 (N, K), bfloat16 bits as int16/uint16, or an Int8Weights (split: int8x2 activations).
_DecoderLinear = tuple[_F32 | npt.NDArray[np.int16] | Int8Weights, _F32 | None, bool]

@final
class CpuKvCaches:
    """The runner's KV cache for the native decoder, borrowed: per layer (K, V), each
    (num_blocks, block_size, H_kv, D) float32 or bfloat16 bits (uint16), or INT8's (K, V,
    K scales, V scales), int8 values and (num_blocks, block_size, H_kv, 1) scales."""

    def __new__(cls, layers: list[tuple[np.ndarray, ...]]) -> CpuKvCaches: ...
    @property
    def num_layers(self) -> int: ...

@final
class CpuDecoder:
    """The whole forward of a dense decoder on the CPU, one call per engine step (GIL
    released). config: the DecoderConfig fields by name; layers: one dict each (norm arrays,
    `_DecoderLinear`s qkv/o/gate_up/down, window, rope index); ropes: (cos, sin) tables."""

    def __new__(
        cls,
        config: dict[str, object],
        embedding: _F32 | npt.NDArray[np.int16],
        layers: list[dict[str, object]],
        final_norm: _F32,
        head: _DecoderLinear,
        ropes: list[tuple[_F32, _F32]],
    ) -> CpuDecoder: ...
    @property
    def weight_bytes(self) -> int: ...
    def step(
        self,
        input_ids: _I32,
        positions: _I32,
        slot_mapping: _I32,
        query_start_loc: _I32,
        seq_lens: _I32,
        block_tables: _I32,
        logits_rows: _I32,
        caches: CpuKvCaches,
        hidden_out: _F32,
        logits_out: _F32,
        threads: int,
        isa: str | None = None,
    ) -> None:
        """Runs one step: the final hidden states (T, hidden) into hidden_out, the logits of
        logits_rows (S, vocab) into logits_out, the step's K/V into caches."""
