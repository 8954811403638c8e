"""ModelRunner: owns the model and its paged KV cache and executes the scheduler's step plans.

A step plan (the Rust scheduler's StepPlan) is a set of flat int32 arrays — see `execute`. The
runner copies them to the device, writes the new tokens' K/V into their cache slots, runs attention
over each request's cached context, computes logits only for the rows that sample, and samples.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aieng.layers.attention import build_attention_metadata
from aieng.models.loader import load_model, resolve_dtype
from aieng.sampling import SampledLogprobs, Sampler, SamplingBatch, SamplingTable

logger = logging.getLogger(__name__)

CPU_KV_CACHE_FRACTION = 0.2  # of available RAM, when kv_cache_memory is not given


class ModelRunner:
    def __init__(
        self,
        model: str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        seed: int | None = None,
    ):
        """kv_cache_memory: bytes for the KV cache (default on CPU: a fraction of available RAM;
        on CUDA: what `gpu_memory_utilization` of the GPU leaves after a profiling forward of
        `max_num_batched_tokens` tokens; a default budget is capped at what `max_num_seqs`
        full-length sequences can use). seed: the generator of rows without their own seed."""
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None and self.device.type == "cpu":
            dtype = torch.float32
        self.model: Any
        self.model, self.config = load_model(model, dtype, self.device)
        self.dtype = dtype or resolve_dtype(self.config.dtype)
        self.block_size = block_size
        if kv_cache_memory is None:
            kv_cache_memory = (
                self._profile_free_memory(gpu_memory_utilization, max_num_batched_tokens)
                if self.device.type == "cuda"
                else int(available_ram() * CPU_KV_CACHE_FRACTION)
            )
            blocks_per_seq = math.ceil(self.config.max_position_embeddings / block_size)
            kv_cache_memory = min(kv_cache_memory, max_num_seqs * blocks_per_seq * self.block_bytes)
        self.num_blocks = kv_cache_memory // self.block_bytes
        if self.num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {kv_cache_memory} bytes holds no block "
                f"(one block of {block_size} tokens needs {self.block_bytes} bytes)"
            )
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB) on %s",
            self.num_blocks,
            block_size,
            self.num_blocks * self.block_bytes / 2**20,
            self.device,
        )
        self.sampler = Sampler(self.device, seed)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K and V over all layers."""
        c = self.config
        per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
        return per_token * self.block_size * self.dtype.itemsize

    def new_sampling_table(self, capacity: int = 64) -> SamplingTable:
        return SamplingTable(self.config.vocab_size, self.device, capacity)

    @torch.inference_mode()
    def execute(self, plan, sampling: SamplingBatch) -> tuple[np.ndarray, SampledLogprobs]:
        """Run one step. `plan` has the StepPlan's arrays (int32 numpy):
        input_ids, positions, slot_mapping (T,); query_start_loc (R+1,); num_computed_tokens,
        seq_lens (R,); block_tables (R, max_blocks); logits_indices, sample_request_rows (S,).
        `sampling` is `SamplingTable.batch(plan)`. -> (token ids int64 (S,), their logprobs)."""
        if len(plan.input_ids) == 0:
            return np.zeros(0, np.int64), _no_logprobs()
        hidden = self._forward(plan, self.kv_caches)  # (T, hidden)
        if len(plan.logits_indices) == 0:  # only partial prefills this step
            return np.zeros(0, np.int64), _no_logprobs()
        logits_rows = self._tensor(plan.logits_indices)
        logits = self.model.compute_logits(hidden[logits_rows])  # (S, vocab)
        tokens, logprobs = self.sampler(logits, sampling)
        return tokens.cpu().numpy().astype(np.int64), logprobs

    @torch.inference_mode()
    def prompt_logprobs(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Log-probability of each token given the ones before it, through the same forward as
        serving (one prefill into a scratch KV cache): (len(token_ids) - 1,) float32."""
        n = len(token_ids)
        if n < 2:
            raise ValueError(f"scoring needs at least 2 tokens, got {n}")
        if n > self.config.max_position_embeddings:
            raise ValueError(
                f"{n} tokens exceed the model's context of {self.config.max_position_embeddings}"
            )
        num_blocks = math.ceil(n / self.block_size)
        plan = _single_prompt_plan(n, num_blocks, self.block_size)
        plan.input_ids = np.asarray(token_ids, dtype=np.int32)
        hidden = self._forward(plan, self._allocate_kv_caches(num_blocks))
        logits = self.model.compute_logits(hidden[:-1]).float()
        targets = self._tensor(plan.input_ids[1:])
        return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0].cpu()

    def _forward(self, plan, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        attn = build_attention_metadata(
            slot_mapping=self._tensor(plan.slot_mapping),
            query_start_loc=np.asarray(plan.query_start_loc),
            num_computed_tokens=np.asarray(plan.num_computed_tokens),
            seq_lens=np.asarray(plan.seq_lens),
            block_tables=np.asarray(plan.block_tables),
            block_size=self.block_size,
            sliding_window=self.config.sliding_window,
            token_bytes=self.block_bytes // (2 * self.config.num_hidden_layers * self.block_size),
        )
        input_ids, positions = self._tensor(plan.input_ids), self._tensor(plan.positions)
        return self.model(input_ids, positions, attn, kv_caches)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        return tensor.to(self.device, non_blocking=True)

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        shape = (num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        # Zeroed: masked context positions are read through block 0 and must be finite.
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(c.num_hidden_layers)
        ]

    @torch.inference_mode()
    def _profile_free_memory(self, utilization: float, num_tokens: int) -> int:
        """Bytes left for the KV cache: utilization * total GPU memory, less what is in use and
        the activation peak of a forward over `num_tokens` tokens."""
        num_tokens = min(num_tokens, self.config.max_position_embeddings)
        num_blocks = math.ceil(num_tokens / self.block_size)
        kv_caches = self._allocate_kv_caches(num_blocks)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._forward(_single_prompt_plan(num_tokens, num_blocks, self.block_size), kv_caches)
        torch.cuda.synchronize(self.device)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - before
        del kv_caches
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total * utilization - (total - free) - activation_peak)


def _no_logprobs() -> SampledLogprobs:
    return SampledLogprobs(
        chosen=np.zeros(0, np.float32),
        top_ids=np.zeros((0, 0), np.int64),
        top_logprobs=np.zeros((0, 0), np.float32),
        num_top=np.zeros(0, np.int32),
    )


@dataclass
class _ProfilePlan:
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    num_computed_tokens: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray


def _single_prompt_plan(num_tokens: int, num_blocks: int, block_size: int) -> _ProfilePlan:
    positions = np.arange(num_tokens, dtype=np.int32)
    return _ProfilePlan(
        input_ids=np.zeros(num_tokens, np.int32),
        positions=positions,
        slot_mapping=positions,
        query_start_loc=np.array([0, num_tokens], np.int32),
        num_computed_tokens=np.zeros(1, np.int32),
        seq_lens=np.array([num_tokens], np.int32),
        block_tables=np.arange(num_blocks, dtype=np.int32)[None],
    )


def available_ram() -> int:
    """MemAvailable from /proc/meminfo, else free physical pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
