"""CUDA graphs for decode steps: the model's forward over R decode rows, captured once per size
and replayed over the runner's persistent buffers, so a decode step launches one graph instead of
hundreds of kernels from Python.

Sizes: 1, 2, 4, 8, then every multiple of 16 up to `max_num_seqs`, and `max_num_seqs` itself.
A step whose rows all decode one token (no prefill) and number R pads to the smallest captured
size S >= R: rows R..S-1 decode token 0 at position 0 of a scratch block — the runner allocates
two past the core's pool, so padding never writes a real block — and their outputs are dropped.
Steps with a prefill, and every step on a CPU or with `enforce_eager`, run eagerly. Once
captured, a replayed step is checked against the eager forward of the same rows (in the second
scratch block); a disagreement, like a failed capture, turns graphs off with a warning.

What a graph replays must read only persistent tensors, so attention needs metadata built from
them on the device: `GraphDecodeInputs` holds the step's cache slots, sequence lengths and block
tables at fixed addresses; the backend's `graph_metadata(inputs)` (or, for the torch and cuda
backends, the adapters below) turns them into its metadata once, at capture. A backend without
one runs eagerly.

Context buckets: a captured grid is fixed, so the cuda backend's split-K plan is made at capture
for a context length, not the live one. Planned for the longest context the engine allows, a
batch of one 1k context under a 32k limit would run 94 splits of which 3 hold positions. So each
size is captured once per context bucket — 1024, 2048, ... positions up to max_model_len
(`context_buckets`) — keeping only the buckets whose plan differs from the next one's
(`distinct_buckets`: sizes that never split, windows shorter than a bucket), and a step replays
the smallest bucket that holds its longest live context.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from aieng.attention import ForwardContext
from aieng.kernels.self_check import relative_error
from aieng.worker.step_plan import ForwardArrays, ForwardPlan

logger = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 16
# Scratch blocks past the core's: the first takes the padding rows' K/V, the second the rows
# of the start-up check.
GRAPH_PAD_BLOCKS = 2
# A replayed step's relative error against the eager forward beyond which graphs are turned off.
GRAPH_TOLERANCE = 2e-2
# The smallest context bucket (positions); each next one doubles, up to max_model_len.
MIN_CONTEXT_BUCKET = 1024


def context_buckets(max_context: int) -> list[int]:
    """MIN_CONTEXT_BUCKET, twice that, ... below max_context, then max_context itself."""
    if max_context < 1:
        raise ValueError(f"the largest context must be at least 1, got {max_context}")
    buckets = []
    bucket = MIN_CONTEXT_BUCKET
    while bucket < max_context:
        buckets.append(bucket)
        bucket *= 2
    return [*buckets, max_context]


def distinct_buckets(buckets: list[int], plan_of: Callable[[int], Hashable]) -> list[int]:
    """The buckets worth a graph of their own: a bucket whose plan (`plan_of(bucket)`) is the
    next bucket's is served by that one (the same kernels and grids, over contexts it holds)."""
    plans = [plan_of(bucket) for bucket in buckets]
    kept = [b for b, plan, after in zip(buckets, plans, plans[1:], strict=False) if plan != after]
    return [*kept, buckets[-1]]


def bucket_for(context: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `context` positions (the last one holds every context
    the engine allows)."""
    return next((bucket for bucket in buckets if bucket >= context), buckets[-1])


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16, up to and including max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes = [s for s in SMALL_SIZES if s < max_num_seqs]
    sizes += range(SIZE_STEP, max_num_seqs, SIZE_STEP)
    return [*sizes, max_num_seqs]


def padded_size(rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding `rows` decode rows; None: more rows than any."""
    return next((size for size in sizes if size >= rows), None)


def is_decode_only(query_start_loc: np.ndarray) -> bool:
    """Every request of the step brings exactly one new token."""
    lengths = np.diff(np.asarray(query_start_loc))
    return len(lengths) > 0 and bool(np.all(lengths == 1))


def step_bucket(plan: Any, sizes: list[int], buckets: dict[int, list[int]]) -> int:
    """The context bucket a decode step replays: of its padded size's buckets, the smallest
    that holds its longest live context."""
    size = padded_size(len(plan.input_ids), sizes)
    longest = int(np.max(plan.seq_lens)) if len(plan.seq_lens) else 1
    return bucket_for(longest, buckets[size if size is not None else sizes[-1]])


@dataclass
class PaddedDecode:
    """A decode step's arrays padded to a captured size (host numpy)."""

    input_ids: np.ndarray  # (S,)
    positions: np.ndarray  # (S,)
    slot_mapping: np.ndarray  # (S,)
    seq_lens: np.ndarray  # (S,) int32
    block_tables: np.ndarray  # (S, W) int32


def pad_decode(
    plan: ForwardPlan,
    block_tables: np.ndarray,
    size: int,
    width: int,
    pad_block: int,
    block_size: int,
) -> PaddedDecode:
    """R decode rows of `plan` (its input_ids, positions, slot_mapping, seq_lens) and their
    block tables (R, w <= width) -> `size` rows of `width` blocks. Padding rows read and write
    token 0 of `pad_block` with a context of one; padding columns name `pad_block` (masked)."""
    rows = len(plan.input_ids)
    ids = np.zeros(size, np.int64)
    positions = np.zeros(size, np.int64)
    slots = np.full(size, pad_block * block_size, np.int64)
    seq_lens = np.ones(size, np.int32)
    tables = np.full((size, width), pad_block, np.int32)
    ids[:rows] = plan.input_ids
    positions[:rows] = plan.positions
    slots[:rows] = plan.slot_mapping
    seq_lens[:rows] = plan.seq_lens
    tables[:rows, : block_tables.shape[1]] = block_tables
    return PaddedDecode(ids, positions, slots, seq_lens, tables)


@dataclass
class GraphDecodeInputs:
    """A decode step's attention inputs at fixed device addresses (S rows), for live contexts
    of at most `planned_len` positions (the graph's context bucket)."""

    slot_mapping: torch.Tensor  # (S,) int64
    seq_lens: torch.Tensor  # (S,) int32
    block_tables: torch.Tensor  # (S, W) int32
    block_size: int
    planned_len: int

    @property
    def num_rows(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def max_context(self) -> int:
        return self.block_tables.shape[1] * self.block_size


def torch_graph_metadata(backend: Any, inputs: GraphDecodeInputs) -> Any:
    """The torch reference's metadata for a captured decode step: one group of all S rows over
    the whole table width, masked on the device by each row's length (and each window). Correct,
    not fast: every row gathers max_context positions."""
    from aieng.attention.torch_paged import AttentionMetadata, DecodeGroup

    lens = inputs.seq_lens.long()[:, None]  # (S, 1)
    positions = torch.arange(inputs.max_context, device=lens.device)[None]  # (1, L)
    masks = {}
    for window in backend.sliding_windows:
        mask = positions < lens
        if window is not None:
            mask &= positions > lens - 1 - window
        masks[window] = mask[:, None, None, :]  # (S, 1, 1, L)
    rows = slice(0, inputs.num_rows)
    group = DecodeGroup(rows, inputs.block_tables, inputs.max_context, masks)
    return AttentionMetadata(inputs.slot_mapping, inputs.num_rows, [group], [], False)


def cuda_graph_metadata(backend: Any, inputs: GraphDecodeInputs) -> Any:
    """The cuda backend's metadata for a captured decode step: its decode batch over the
    persistent arrays, split-K planned for the graph's context bucket."""
    from aieng.attention.cuda_paged import CudaAttentionMetadata, DecodeBatch

    device = inputs.seq_lens.device
    rows = torch.arange(inputs.num_rows, dtype=torch.int32, device=device)
    live = np.ones(inputs.num_rows, np.int64)  # unknown at capture: read on the device
    decode = DecodeBatch(rows, inputs.seq_lens, inputs.block_tables, live, inputs.planned_len)
    return CudaAttentionMetadata(inputs.slot_mapping, inputs.num_rows, decode, None)


def cuda_plan_of(backend: Any, runner: Any, rows: int) -> Callable[[int], Hashable]:
    """For `rows` decode rows of the runner's model on the cuda backend: context length -> the
    split-K plans of its layers (one per sliding window), as `distinct_buckets` compares them;
    an unsplit plan is the same for every length (its one split reads each row's context)."""
    from aieng.attention.backend import QuantizedKVCache
    from aieng.attention.cuda_paged import plan_for_lengths
    from aieng.distributed.parallel_state import heads_per_rank
    from aieng.kernels.paged_attention import decode_kernel_name

    cache = runner.kv_caches[0]
    int8 = isinstance(cache, QuantizedKVCache)
    _, _, kv_heads, head_dim = (cache.k if int8 else cache[0]).shape
    config = runner.model_config
    heads = heads_per_rank(config.num_attention_heads)
    ctas = backend.ctas_per_sm(decode_kernel_name(runner.dtype, int8, head_dim, heads // kv_heads))
    windows = dict.fromkeys(
        getattr(config, "layer_sliding_windows", ()) or (config.sliding_window,)
    )

    def plan_of(length: int) -> Hashable:
        lengths = np.full(rows, length, np.int64)
        plans = (
            plan_for_lengths(lengths, w, heads, kv_heads, head_dim, backend.num_sms, ctas)
            for w in windows
        )
        return tuple(plan if plan.num_splits > 1 else None for plan in plans)

    return plan_of


GRAPH_ADAPTERS = {"torch": torch_graph_metadata, "cuda": cuda_graph_metadata}
# Backends whose graph plans depend on the context (the rest capture one bucket per size).
GRAPH_PLANS = {"cuda": cuda_plan_of}


def graph_buckets(backend: Any, runner: Any, rows: int, max_context: int) -> list[int]:
    """The context buckets to capture for `rows` rows: one (max_context) unless the backend
    plans by the context (`GRAPH_PLANS`), then the distinct ones of `context_buckets`."""
    plans = GRAPH_PLANS.get(getattr(backend, "name", ""))
    if plans is None:
        return [max_context]
    return distinct_buckets(context_buckets(max_context), plans(backend, runner, rows))


def supports_graphs(backend: Any) -> bool:
    return hasattr(backend, "graph_metadata") or getattr(backend, "name", "") in GRAPH_ADAPTERS


def graph_metadata(backend: Any, inputs: GraphDecodeInputs) -> Any:
    """The backend's metadata over persistent inputs (its own `graph_metadata`, else the
    adapter for its name)."""
    if hasattr(backend, "graph_metadata"):
        return backend.graph_metadata(inputs)
    return GRAPH_ADAPTERS[backend.name](backend, inputs)


def graphs_wanted(enforce_eager: bool, device: torch.device) -> bool:
    return not enforce_eager and device.type == "cuda"


class DecodeGraphs:
    """The captured decode graphs of one runner. `run(plan, block_tables)` replays the one for
    the plan's padded size and returns the hidden states of its R rows; `forward_padded` runs
    the same computation eagerly (what the graph holds, on any device)."""

    def __init__(self, runner: Any, max_num_seqs: int, pad_block: int):
        """runner: a ModelRunner (its model, attention backend, KV caches, input buffers, block
        size, max_model_len) with GRAPH_PAD_BLOCKS blocks from `pad_block` on past its pool."""
        self.runner = runner
        self.sizes = capture_sizes(max_num_seqs)
        self.pad_block = pad_block
        self.block_size = runner.block_size
        self.width = -(-runner.max_model_len // self.block_size)
        device, largest = runner.device, self.sizes[-1]
        pin = device.type == "cuda"
        self._seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self._tables = torch.full(
            (largest, self.width), pad_block, dtype=torch.int32, device=device
        )
        self._host_seq_lens = torch.ones(largest, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros((largest, self.width), dtype=torch.int32, pin_memory=pin)
        # (size, context bucket) -> its graph and the hidden states it writes
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.max_context = min(runner.max_model_len, self.width * self.block_size)
        self.buckets = {
            size: graph_buckets(runner.attention, runner, size, self.max_context)
            for size in self.sizes
        }

    def bucket(self, plan: Any) -> int:
        return step_bucket(plan, self.sizes, self.buckets)

    def _pad(self, plan: Any, block_tables: np.ndarray) -> PaddedDecode:
        size = padded_size(len(plan.input_ids), self.sizes)
        if size is None:
            raise ValueError(
                f"{len(plan.input_ids)} rows exceed the largest graph, {self.sizes[-1]}"
            )
        return pad_decode(plan, block_tables, size, self.width, self.pad_block, self.block_size)

    def _empty_step(self, size: int) -> PaddedDecode:
        empty = np.zeros(0, np.int64)
        plan = ForwardArrays(empty, empty, empty, np.zeros(1, np.int64), empty, empty)
        tables = np.zeros((0, self.width), np.int32)
        return pad_decode(plan, tables, size, self.width, self.pad_block, self.block_size)

    def _write(self, step: PaddedDecode) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The padded step into the persistent buffers -> (ids, positions, slots): views of the
        runner's input buffers, new objects each time over the same memory."""
        size = len(step.input_ids)
        self._host_seq_lens[:size].copy_(torch.from_numpy(step.seq_lens))
        self._host_tables[:size].copy_(torch.from_numpy(step.block_tables))
        self._seq_lens[:size].copy_(self._host_seq_lens[:size], non_blocking=True)
        self._tables[:size].copy_(self._host_tables[:size], non_blocking=True)
        return self.runner.inputs.write(step.input_ids, step.positions, step.slot_mapping)

    def _model(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, bucket: int
    ) -> torch.Tensor:
        """The model over the persistent buffers with the backend's graph metadata for contexts
        of at most `bucket` positions -> (S, hidden): what a graph holds. Fresh `ids`/`positions`
        views make per-step caches keyed by the tensor objects (the rotary cos/sin lookup)
        compute inside the graph."""
        size, runner = len(ids), self.runner
        inputs = GraphDecodeInputs(
            slots, self._seq_lens[:size], self._tables[:size], self.block_size, bucket
        )
        metadata = graph_metadata(runner.attention, inputs)
        ctx = ForwardContext(runner.attention, metadata, runner.kv_caches)
        return runner.model(ids, positions, ctx)

    def forward_padded(
        self, plan: Any, block_tables: np.ndarray, bucket: int | None = None
    ) -> torch.Tensor:
        """The graph's computation run eagerly (for the step's bucket, or `bucket`) -> (R,
        hidden) of the plan's R rows."""
        bucket = self.bucket(plan) if bucket is None else bucket
        views = self._write(self._pad(plan, block_tables))
        return self._model(*views, bucket)[: len(plan.input_ids)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size and context bucket, largest first, in one memory pool; each is run
        eagerly once before (kernels compiled and loaded, lazy buffers allocated)."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            for bucket in reversed(self.buckets[size]):
                step = self._empty_step(size)
                self._model(*self._write(step), bucket)  # warm-up
                views = self._write(step)
                torch.cuda.synchronize(self.runner.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self._model(*views, bucket)
                self._graphs[size, bucket] = (graph, hidden)
        torch.cuda.synchronize(self.runner.device)
        logger.info(
            "CUDA graphs: captured %d decode graphs, rows (context buckets): %s",
            len(self._graphs),
            ", ".join(f"{size} ({'/'.join(map(str, self.buckets[size]))})" for size in self.sizes),
        )

    def can_run(self, plan: Any) -> bool:
        rows = len(plan.input_ids)
        return (
            bool(self._graphs)
            and padded_size(rows, self.sizes) is not None
            and is_decode_only(plan.query_start_loc)
        )

    def run(self, plan: Any, block_tables: np.ndarray, bucket: int | None = None) -> torch.Tensor:
        """Replay the graph of the plan's padded size and context bucket (or `bucket`, one that
        holds its contexts) -> (R, hidden) of its R rows."""
        step = self._pad(plan, block_tables)
        self._write(step)
        bucket = self.bucket(plan) if bucket is None else bucket
        graph, hidden = self._graphs[len(step.input_ids), bucket]
        graph.replay()
        return hidden[: len(plan.input_ids)]

    @torch.inference_mode()
    def check(self, replay: bool = True) -> float:
        """Graph steps against the eager forward of the same rows (the worst relative error of
        their hidden states): random tokens r = 0..R-1 at position r of the second scratch
        block, each attending to the ones before it, padded by one row, replayed in the
        smallest and the largest context bucket of their size (the most splits past the live
        context). replay=False runs the graphs' computation eagerly (`forward_padded`)."""
        plan, tables = self.check_step()
        eager = self.runner._forward(plan, tables, self.runner.kv_caches).float().clone()
        buckets = self.buckets[padded_size(len(plan.input_ids), self.sizes) or self.sizes[-1]]
        errors = []
        for bucket in dict.fromkeys((buckets[0], buckets[-1])):
            run = self.run if replay else self.forward_padded
            padded = run(plan, tables, bucket)
            errors.append(relative_error(padded.float(), eager))
        return max(errors)

    def check_step(self) -> tuple[ForwardArrays, np.ndarray]:
        block = self.pad_block + 1
        size = max(s for s in self.sizes if s <= self.block_size)
        rows = max(1, size - 1)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.runner.model_config.vocab_size, (rows,), generator=generator)
        positions = np.arange(rows, dtype=np.int64)
        plan = ForwardArrays(
            input_ids=ids.numpy(),
            positions=positions,
            slot_mapping=block * self.block_size + positions,
            query_start_loc=np.arange(rows + 1),
            num_computed_tokens=positions,
            seq_lens=(positions + 1).astype(np.int32),
        )
        return plan, np.full((rows, 1), block, np.int32)


def capture_decode_graphs(runner: Any, max_num_seqs: int, pad_block: int) -> DecodeGraphs | None:
    """The runner's decode graphs, captured and checked; None (every step eager) when its
    attention backend cannot be replayed, the capture fails or a replay disagrees with the eager
    forward — logged, never fatal."""
    if not supports_graphs(runner.attention):
        logger.info(
            "CUDA graphs off: the %s attention backend has no graph metadata", runner.attention.name
        )
        return None
    graphs = DecodeGraphs(runner, max_num_seqs, pad_block)
    try:
        graphs.capture()
        error = graphs.check()
    except Exception as error:  # a capture that fails leaves eager steps, which still work
        logger.warning("CUDA graphs off: capturing the decode steps failed (%s)", error)
        return None
    if not error <= GRAPH_TOLERANCE:
        logger.warning(
            "CUDA graphs off: a replayed decode step differs from the eager one (relative error "
            "%.2e > %.0e)",
            error,
            GRAPH_TOLERANCE,
        )
        return None
    return graphs
