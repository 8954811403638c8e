"""The draft model of `draft_model` speculation, on the device next to the target (the
ModelRunner holds it): after each target step it catches up on the tokens the step settled
and proposes the next k tokens of every request that sampled.

Its KV cache has one tensor per draft layer with as many blocks as the target's and is indexed
by the SAME block table and slots: the core's allocator, prefix caching and preemption cover
it. Every step the draft writes, at the positions the target computed, the request's true
tokens (the prompt chunk, then the accepted tokens and the one just sampled), so a block the
target filled also holds the draft's K/V of the same tokens. The proposal steps write past the
request's blocks into a few scratch blocks per row (after the core's blocks), overwritten the
next step; positions past the accepted length are simply written again later.

Each draft token is the draft's argmax for greedy, seeded and grammar-constrained requests (a
point mass, so a seeded request gives the same tokens as without speculation, and the core may
cut a grammar request's draft where its grammar forbids), and otherwise a draw from
q = softmax(draft logits / temperature); q goes to the verifier, which accepts with
min(1, p/q) (`aieng.worker.sampler.rejection_sample`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from aieng.attention import AttentionInputs, ForwardContext, KVCache, select_attention_backend
from aieng.config.engine_config import EngineConfig
from aieng.models.loader import load_model
from aieng.worker.cpu_native import native_decoder
from aieng.worker.kv_cache import KVCacheSpec, resolve_kv_cache_dtype
from aieng.worker.sampler import SamplingTable
from aieng.worker.step_plan import ForwardArrays


@dataclass(frozen=True)
class StepResult:
    """What the target's step settled, per sampling request g of the plan (G,)."""

    starts: np.ndarray  # first logits row of each request
    sizes: np.ndarray  # its logits rows: 1 + its drafts
    counts: np.ndarray  # tokens it took
    tokens: np.ndarray  # the taken tokens, flat, request after request (-1: failed)

    @classmethod
    def none(cls) -> StepResult:
        """A step that sampled nothing (only partial prefills)."""
        empty = np.zeros(0, np.int64)
        return cls(empty, empty, empty, empty)


class DraftModel:
    def __init__(self, config: EngineConfig):
        """The draft of `config.speculative` (method draft_model), next to the target: on its
        device, in its dtype, with its block size, KV cache dtype and attention backend."""
        spec = config.speculative
        if spec is None or spec.model is None:
            raise ValueError("DraftModel: the config's speculative_config names no draft model")
        device, dtype = config.torch_device, config.torch_dtype
        block_size = config.cache.block_size
        kv_cache_dtype = config.cache.kv_cache_dtype
        max_model_len = config.scheduler.max_model_len
        self.model, self.model_config = load_model(spec.model, dtype, device)
        if self.model_config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_config 'model': the draft's context "
                f"({self.model_config.max_position_embeddings} positions) is shorter than "
                f"max_model_len ({max_model_len})"
            )
        self.k = spec.num_speculative_tokens
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        attention_cache = "int8" if kv_cache_dtype == "int8" else "auto"
        self.attention = select_attention_backend(
            config.runner.attention_backend, self.model_config, device, dtype, attention_cache,
            block_size,
        )  # fmt: skip
        # On the CPU the draft's forward is the native decoder's too, where it is covered.
        self.native = native_decoder(
            config.runner.cpu_native, self.model, self.model_config, device, self.attention.name
        )
        kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, self.native is not None)
        self.kv_spec = KVCacheSpec.for_model(self.model_config, block_size, dtype, kv_cache_dtype)
        if self.native is None and self.kv_spec.dtype not in (dtype, torch.int8):
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r}: the draft model's cache is read by the native "
                "CPU decoder only, which does not serve the draft here"
            )
        # Scratch blocks per row: the proposal steps reach at most k positions past its blocks.
        self.scratch_per_row = math.ceil(self.k / block_size) + 1
        self.max_rows = config.scheduler.max_num_seqs
        self.scratch_base = 0
        self.kv_caches: list[KVCache] = []
        self.generator = torch.Generator(device)
        self.generator.manual_seed(0)
        # slot -> (drafts proposed last step (k,), the q each was drawn from (k, V) or None)
        self.proposed: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}

    @property
    def block_bytes(self) -> int:
        return self.kv_spec.block_bytes

    def allocate(self, num_blocks: int) -> None:
        """The cache: `num_blocks` blocks indexed as the target's, then the scratch rows."""
        self.scratch_base = num_blocks
        total = num_blocks + self.max_rows * self.scratch_per_row
        self.kv_caches = self.kv_spec.allocate(total, self.device, self.attention)

    def proposals(
        self, plan, starts: np.ndarray, sizes: np.ndarray, drafts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """For the verifier: (logits rows, q (P, V)) of the rows whose draft this model drew
        from q last step — those the plan runs unchanged (the core may have cut them short)."""
        rows: list[np.ndarray] = []
        qs: list[np.ndarray] = []
        slots = np.asarray(plan.slots)[np.asarray(plan.sample_request_rows)[starts]]
        for start, size, slot in zip(starts.tolist(), sizes.tolist(), slots.tolist(), strict=True):
            given = self.proposed.get(slot)
            n = size - 1
            if n == 0 or given is None or given[1] is None or len(given[0]) < n:
                continue
            if not np.array_equal(drafts[start : start + n], given[0][:n]):
                continue  # not this model's drafts: a point mass, as any proposer's
            rows.append(np.arange(start, start + n))
            qs.append(given[1][:n])
        if not rows:
            return None
        return np.concatenate(rows), np.concatenate(qs).astype(np.float32)

    @torch.inference_mode()
    def step(
        self, plan, block_table: np.ndarray, result: StepResult, table: SamplingTable
    ) -> dict[int, list[int]]:
        """Runs the draft over the true tokens of every row of the target's step, then k
        proposal steps for the requests that sampled. block_table (R, W): the rows' blocks.
        Returns {slot: drafts}."""
        self.proposed = {}
        rows = np.asarray(plan.slots, np.int64)
        num_rows = len(rows)
        if num_rows == 0 or num_rows > self.max_rows:
            return {}
        qsl = np.asarray(plan.query_start_loc, np.int64)
        computed = np.asarray(plan.num_computed_tokens, np.int64)
        seq_lens = np.asarray(plan.seq_lens, np.int64)
        input_ids = np.asarray(plan.input_ids, np.int64)
        sample_rows = np.asarray(plan.sample_request_rows, np.int64)[result.starts]
        # Per row: the true tokens of its plan slice, then (a sampling row) the token it took.
        keep = qsl[1:] - qsl[:-1]
        last = np.full(num_rows, -1, np.int64)
        proposing = np.zeros(num_rows, bool)
        counts = np.asarray(result.counts, np.int64)
        tokens = np.asarray(result.tokens, np.int64)
        offsets = np.r_[0, np.cumsum(counts)[:-1]].astype(np.int64)
        failed = counts == 0
        failed[np.repeat(np.arange(len(counts)), counts)[tokens < 0]] = True
        keep[sample_rows[failed]] = 0  # a failed request: it is gone
        ok = ~failed
        took = sample_rows[ok]
        sizes = np.asarray(result.sizes, np.int64)[ok]
        keep[took] -= sizes - counts[ok]  # its drafts past the accepted ones
        last[took] = tokens[offsets[ok] + counts[ok] - 1]
        proposing[took] = True
        # Each row's kept plan tokens, then the token it took (a sampling row), flat.
        keep = np.maximum(keep, 0)
        lengths = keep + (last >= 0)
        row_of = np.repeat(np.arange(num_rows), lengths)
        index = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        from_plan = index < keep[row_of]
        source = np.where(from_plan, qsl[row_of] + index, 0)
        flat_ids = np.where(from_plan, input_ids[source], last[row_of])
        flat_positions = computed[row_of] + index
        table_rows = self._block_table(block_table, seq_lens)
        active = np.flatnonzero(lengths > 0)  # a failed request's row has none
        if not len(active):
            return {}
        hidden = self._forward(
            flat_ids,
            flat_positions,
            computed[active],
            lengths[active],
            table_rows[active],
        )
        ends = np.full(num_rows, -1, np.int64)
        ends[active] = np.cumsum(lengths[active]) - 1
        if not proposing.any():
            return {}
        # Proposal steps, on the rows that sampled and have room left in the context.
        prop = np.flatnonzero(proposing)
        next_pos = computed[prop] + lengths[prop]  # where each row's first draft goes
        logits = self.model.compute_logits(hidden[torch.from_numpy(ends[prop]).to(self.device)])
        slots = rows[prop]
        # a point mass where the draft must not be a draw: greedy, seeded and grammar rows (the
        # core cuts a grammar row's draft where the grammar forbids, which a draw's q cannot see)
        greedy = table.greedy[slots] | table.has_seed[slots] | table.has_grammar[slots]
        temperature = torch.from_numpy(table.floats[slots, 0].astype(np.float32)).to(self.device)
        drafts: list[np.ndarray] = []
        qs: list[torch.Tensor] = []
        limit = min(self.max_model_len, self.model_config.max_position_embeddings)
        room = np.minimum(limit - next_pos, self.k)
        for j in range(int(room.max(initial=0))):
            token, q = self._draw(logits, greedy, temperature)
            drafts.append(token)
            qs.append(q)
            if j + 1 >= int(room.max()):
                break
            pos = next_pos + j
            going = np.flatnonzero(room > j + 1)
            hidden = self._forward(
                token[going],
                pos[going],
                pos[going],
                np.ones(len(going), np.int64),
                table_rows[prop[going]],
            )
            if len(going) < len(prop):  # rows out of room keep a row of zeros
                full = hidden.new_zeros(len(prop), hidden.shape[-1])
                full[torch.from_numpy(going).to(self.device)] = hidden
                hidden = full
            logits = self.model.compute_logits(hidden)
        if not drafts:
            return {}
        stacked = np.stack(drafts, axis=1)  # (P, steps)
        q_host = torch.stack(qs, dim=1).cpu().numpy() if not greedy.all() else None
        out: dict[int, list[int]] = {}
        for i, slot in enumerate(slots.tolist()):
            n = int(room[i])
            if n <= 0:
                continue
            mine = stacked[i, :n]
            q = None if greedy[i] or q_host is None else q_host[i, :n]
            self.proposed[slot] = (mine, q)
            out[slot] = mine.tolist()
        return out

    def _draw(
        self, logits: torch.Tensor, greedy: np.ndarray, temperature: torch.Tensor
    ) -> tuple[np.ndarray, torch.Tensor]:
        """One draft token per row: the argmax on greedy rows, else a draw from
        q = softmax(logits / temperature); -> (tokens (P,), q (P, V); (P, 0) when all are
        greedy)."""
        logits = logits.float()
        token = logits.argmax(dim=-1)
        if greedy.all():
            return token.cpu().numpy().astype(np.int64), logits[:, :0]
        safe = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        q = torch.softmax(logits / safe[:, None], dim=-1)
        drawn = torch.multinomial(q, 1, generator=self.generator)[:, 0]
        token = torch.where(torch.from_numpy(~greedy).to(self.device), drawn, token)
        return token.cpu().numpy().astype(np.int64), q

    def _block_table(self, block_table: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        """(R, W + scratch) block ids: each row's own blocks (those covering its plan), then
        its scratch blocks."""
        own = -(-seq_lens // self.block_size)
        width = int(own.max()) + self.scratch_per_row
        table = np.zeros((len(seq_lens), width), np.int64)
        have = min(width, block_table.shape[1])
        column = np.arange(width)[None, :]
        mine = column[:, :have] < own[:, None]
        table[:, :have] = np.where(mine, block_table[:, :have], 0)
        past = column - own[:, None]  # a scratch block's index where 0 <= past < scratch_per_row
        first = self.scratch_base + np.arange(len(seq_lens))[:, None] * self.scratch_per_row
        scratch = (past >= 0) & (past < self.scratch_per_row)
        return np.where(scratch, first + past, table)

    def _forward(
        self,
        ids: np.ndarray,
        positions: np.ndarray,
        computed: np.ndarray,
        lengths: np.ndarray,
        block_table: np.ndarray,
    ) -> torch.Tensor:
        """One forward of rows of `lengths` tokens each, the first at position `computed`."""
        positions = np.asarray(positions, np.int64)
        row_of = np.repeat(np.arange(len(lengths)), lengths)
        blocks = block_table[row_of, positions // self.block_size]
        slot_mapping = blocks * self.block_size + positions % self.block_size
        if self.native is not None:
            arrays = ForwardArrays(
                input_ids=np.asarray(ids, np.int32),
                positions=positions.astype(np.int32),
                slot_mapping=slot_mapping.astype(np.int32),
                query_start_loc=np.r_[0, np.cumsum(lengths)].astype(np.int32),
                num_computed_tokens=np.asarray(computed, np.int32),
                seq_lens=(np.asarray(computed) + lengths).astype(np.int32),
            )
            return self.native.forward(arrays, block_table, self.kv_caches)[0]
        metadata = self.attention.build_metadata(
            AttentionInputs(
                slot_mapping=torch.from_numpy(slot_mapping).to(self.device),
                query_start_loc=np.r_[0, np.cumsum(lengths)].astype(np.int32),
                num_computed_tokens=np.asarray(computed, np.int32),
                seq_lens=(np.asarray(computed) + lengths).astype(np.int32),
                block_tables=block_table.astype(np.int32),
                block_size=self.block_size,
            )
        )
        ctx = ForwardContext(self.attention, metadata, self.kv_caches)
        input_ids = torch.from_numpy(np.asarray(ids, np.int64)).to(self.device)
        return self.model(input_ids, torch.from_numpy(positions).to(self.device), ctx)
