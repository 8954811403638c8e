"""Which share of each layer this tensor-parallel rank holds (Megatron-LM's split, Shoeybi et al.,
2019; vLLM's rules for grouped-query attention).

A linear layer is one of three kinds:
- replicated: every rank holds the whole layer (the MoE router);
- column-parallel (q/k/v, gate/up, the LM head): each rank holds a slice of every output block
  (q|k|v fused: its query heads, and the KV heads those use), so its output is its share of the
  columns and needs no communication;
- row-parallel (o_proj, down_proj): each rank holds a slice of the input columns — the slice of
  the column-parallel output it already has — and the partial products are summed over the ranks
  (`reduce`; an MoE's experts leave that to the layer, which sums once after combining them).

Attention heads split evenly; when there are fewer KV heads than ranks, each KV head is held by
N / num_kv_heads ranks (replicated), each rank keeping the one its query heads read. The
vocabulary is split in equal shares of ceil(V / N) rows: the last rank's share is padded (rows
that stay zero and whose logits are cut off after the gather), so no vocabulary size is refused.

Every rule reads the rank from `aieng.distributed.parallel_state`: with one rank (the default) each
layer is whole and every slice is the full range, so TP=1 is today's model exactly. Shapes that
cannot be shared raise one ValueError naming the config field.
"""

from __future__ import annotations

from dataclasses import dataclass

from aieng.distributed.parallel_state import (
    get_tp_rank,
    get_tp_world_size,
    heads_per_rank,
    kv_head_range,
    shard_range,
)

Slice = tuple[int, int]  # (start, size)


@dataclass(frozen=True)
class LinearShard:
    """This rank's part of a linear layer. output_slices: for each output block, the (start,
    size) of the rows this rank holds within the block (a padded vocabulary share may run past
    the block's end). input_slice: the input columns this rank holds. reduce: the output is a
    partial sum, to be all-reduced by the layer."""

    output_slices: tuple[Slice, ...]
    input_slice: Slice
    reduce: bool = False

    def output_sharded(self, full_sizes: list[int]) -> bool:
        return any(s != (0, full) for s, full in zip(self.output_slices, full_sizes, strict=True))

    def input_sharded(self, full_input: int) -> bool:
        return self.input_slice != (0, full_input)


def replicated(input_size: int, output_sizes: list[int]) -> LinearShard:
    return LinearShard(tuple((0, size) for size in output_sizes), (0, input_size))


def column_parallel(input_size: int, output_sizes: list[int], what: str) -> LinearShard:
    """Each output block split evenly; `what` names the size in an error (e.g. the config's
    "intermediate_size")."""
    slices = []
    for size in output_sizes:
        start, end = shard_range(size, what)
        slices.append((start, end - start))
    return LinearShard(tuple(slices), (0, input_size))


def row_parallel(
    input_size: int, output_sizes: list[int], what: str, reduce: bool = True
) -> LinearShard:
    start, end = shard_range(input_size, what)
    return LinearShard(tuple((0, size) for size in output_sizes), (start, end - start), reduce)


def qkv_parallel(input_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> LinearShard:
    """The fused q|k|v projection: this rank's query heads, and the KV heads they read."""
    q_start, _ = shard_range(num_heads, "num_attention_heads")
    q_count = heads_per_rank(num_heads)
    kv_start, kv_count = kv_head_range(num_kv_heads)
    q = (q_start * head_dim, q_count * head_dim)
    kv = (kv_start * head_dim, kv_count * head_dim)
    return LinearShard((q, kv, kv), (0, input_size))


def vocab_share(vocab_size: int) -> Slice:
    """(first row, rows per rank) of this rank's vocabulary share: ceil(V / N) rows each."""
    per_rank = -(-vocab_size // get_tp_world_size())
    return get_tp_rank() * per_rank, per_rank


def vocab_parallel(input_size: int, vocab_size: int) -> LinearShard:
    """The LM head: this rank's vocabulary rows (the last share padded)."""
    return LinearShard((vocab_share(vocab_size),), (0, input_size))
