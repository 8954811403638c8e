"""ModelRunner: the device boundary. It owns everything on the device — the model, the KV cache
and its spec, the persistent input buffers, the sampling state and the sampler, the attention
backend — and executes one `RunnerStep` (the core's StepPlan plus the sampling rows that changed)
into one `ModelRunnerOutput`.

A step: apply the plan's new blocks to the persistent block table, write the input ids,
positions and cache slots into the persistent buffers, let the backend build its metadata once,
run the model (each attention layer writes its new K/V and attends over the cache), compute
logits only for the rows that sample, sample, and read the sampled ids back in one transfer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from aieng.attention import AttentionInputs, ForwardContext, KVCache, select_attention_backend
from aieng.config.engine_config import EngineConfig
from aieng.errors import is_fatal
from aieng.kernels.cpu_int8 import cpu_isa
from aieng.kernels.threads import pool_owns_the_cores
from aieng.models.loader import LoadTimes, load_model
from aieng.quantization.methods import describe_linear_kernels
from aieng.worker.cpu_native import NativeDecoder, native_decoder
from aieng.worker.cuda_graphs import GRAPH_PAD_BLOCKS, capture_decode_graphs, graphs_wanted
from aieng.worker.draft_model import DraftModel, StepResult
from aieng.worker.embedding_pooler import EmbeddingPooler, encoder_step
from aieng.worker.gpu_memory import log_gpu_memory
from aieng.worker.host_memory import available_ram
from aieng.worker.input_buffers import InputBuffers
from aieng.worker.isolated_sampling import RowRules
from aieng.worker.kv_cache import KVCacheSpec, resolve_kv_cache_dtype
from aieng.worker.prompt_logprobs import PromptScorer
from aieng.worker.runner_io import ModelRunnerOutput, NewSamplingRow, RunnerStep, SampledLogprobs
from aieng.worker.sampler import Sampler, SamplerOutput, SamplingTable
from aieng.worker.spec_verify import draft_tokens, sampling_groups, verify_and_sample
from aieng.worker.step_plan import ForwardArrays, ForwardPlan

logger = logging.getLogger(__name__)

CPU_KV_CACHE_FRACTION = 0.2  # of available RAM, when kv_cache_memory is not given


class ModelRunner:
    samples = True  # False on tensor-parallel ranks > 0: they run the model, rank 0 samples

    def __init__(self, config: EngineConfig, allocate_cache: bool = True):
        """Loads the model. With `allocate_cache` (a runner on its own: tests, tools) it also
        sizes and allocates its KV cache; a Worker leaves that to its executor, which asks every
        rank `Worker.determine_available_memory()` and then calls `initialize_cache(num_blocks)`."""
        self.engine_config = config
        options = config.runner
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.model: Any
        self.load_times = LoadTimes()
        self.model, self.model_config = load_model(
            config.model_path,
            self.dtype,
            self.device,
            config.model,
            times=self.load_times,
            cpu_quant_kernel=options.cpu_quant_kernel,
            cpu_lm_head=options.cpu_lm_head,
        )
        self.block_size = config.cache.block_size
        self.max_model_len = config.scheduler.max_model_len
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        kv_cache_dtype = config.cache.kv_cache_dtype
        # A float cache of another dtype is the native decoder's: the backend is chosen as for
        # the model's.
        attention_cache = "int8" if kv_cache_dtype == "int8" else "auto"
        self.attention = select_attention_backend(
            options.attention_backend, self.model_config, self.device, self.dtype, attention_cache,
            self.block_size,
        )  # fmt: skip
        if attention_cache not in self.attention.kv_cache_dtypes:
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r}: the attention backend "
                f"{self.attention.name!r} reads only {', '.join(self.attention.kv_cache_dtypes)}"
            )
        max_blocks = math.ceil(self.max_model_len / self.block_size)
        self.inputs = InputBuffers(self.max_num_batched_tokens, max_blocks, self.device)
        self.sampling = SamplingTable(
            self.model_config.vocab_size,
            self.device,
            capacity=max(64, config.scheduler.max_num_seqs),
        )
        self.sampler = Sampler(self.device, options.seed)
        self.prompt_scorer = PromptScorer(self.device)
        self.pooler = EmbeddingPooler()
        # An encoder-only model (BERT family) keeps no KV cache and only embeds.
        self.encoder = getattr(self.model, "is_encoder", False)
        self.num_blocks = 0
        self.kv_caches: list[KVCache] = []
        self.graphs = None
        self.draft = _draft_model(config)  # draft_model speculation: the draft, beside
        # On the CPU, the whole forward in one Rust call where the model is covered.
        self.native: NativeDecoder | None = native_decoder(
            options.cpu_native,
            self.model,
            self.model_config,
            self.device,
            self.attention.name,
        )
        kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype, self.native is not None)
        self.kv_spec = KVCacheSpec.for_model(
            self.model_config, self.block_size, self.dtype, kv_cache_dtype
        )
        if self.native is None and self.kv_spec.dtype not in (self.dtype, torch.int8):
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r} on a {str(self.dtype).removeprefix('torch.')} "
                "model is read "
                "by the native CPU decoder only, which does not serve here (cpu_native, and the "
                "start-up log line 'cpu native decoder: off' say why)"
            )
        if allocate_cache:
            self.initialize_cache(self.num_blocks_for(self.available_kv_cache_memory()))

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocates `num_blocks` KV blocks (every rank the same number), then captures the
        decode CUDA graphs over them where they are wanted."""
        if self.kv_caches:
            raise RuntimeError("the KV cache is already allocated")
        kv_start = time.perf_counter()
        self.num_blocks = num_blocks
        # CUDA graphs pad decode steps with rows that write a scratch block past the core's.
        graphs = graphs_wanted(self.engine_config.runner.enforce_eager, self.device)
        graphs = graphs and not self.encoder
        pad_blocks = GRAPH_PAD_BLOCKS if graphs else 0
        self.kv_caches = self.kv_spec.allocate(
            self.num_blocks + pad_blocks, self.device, self.attention
        )
        if self.draft is not None:  # its blocks are the target's, its scratch after them
            self.draft.allocate(self.num_blocks + pad_blocks)
        self.load_times.kv_cache_s = time.perf_counter() - kv_start
        logger.info("%s", self.load_times.describe())
        logger.info(
            "KV cache: %s, %d blocks of %d tokens = %d tokens (%.1f MiB, %d bytes per token) on "
            "%s; attention backend %s",
            self.kv_spec.cache_dtype,
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.num_blocks * self.kv_spec.block_bytes / 2**20,
            self.kv_spec.block_bytes // self.block_size,
            self.device,
            self.attention.name,
        )
        max_num_seqs = self.engine_config.scheduler.max_num_seqs
        self.graphs = capture_decode_graphs(self, max_num_seqs, num_blocks) if graphs else None
        log_gpu_memory(self)

    def release(self) -> None:
        """Drops the model, the KV cache, the CUDA graphs and the draft model now: the graphs
        hold the runner in a cycle, which would keep them all until a garbage collection."""
        self.graphs = None
        self.kv_caches = []
        self.draft = None
        self.native = None
        self.model = None
        self.num_blocks = 0

    @property
    def block_bytes(self) -> int:
        """A KV block's bytes: the target's, and the draft model's where there is one."""
        draft = self.draft.block_bytes if self.draft is not None else 0
        return self.kv_spec.block_bytes + draft

    def available_kv_cache_memory(self) -> int:
        """Bytes this device gives the KV cache: config.cache.kv_cache_memory, or by default on
        CPU a fraction of available RAM, on CUDA what gpu_memory_utilization of the GPU leaves
        after a profiling forward of max_num_batched_tokens tokens; a default budget is capped
        at what max_num_seqs full-length sequences can use."""
        if self.encoder:  # it keeps no KV cache
            return 0
        cache = self.engine_config.cache
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory
        memory = (
            self._profile_free_memory(cache.gpu_memory_utilization)
            if self.device.type == "cuda"
            else int(available_ram() * CPU_KV_CACHE_FRACTION)
        )
        blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        max_num_seqs = self.engine_config.scheduler.max_num_seqs
        return max(0, min(memory, max_num_seqs * blocks_per_seq * self.block_bytes))

    def kernel_names(self) -> dict[str, str]:
        """The compute paths chosen at load, for the start-up log and /metrics."""
        return {
            "attention_backend": self.attention.name,
            "linear_kernels": describe_linear_kernels(self.model),
            "cpu_isa": cpu_isa() if self.device.type == "cpu" else "",
        }

    def num_blocks_for(self, memory: int) -> int:
        """How many KV blocks `memory` bytes hold (ValueError when not one)."""
        if self.block_bytes == 0:  # an encoder: blocks only count tokens, they hold nothing
            scheduler = self.engine_config.scheduler
            return scheduler.max_num_seqs * math.ceil(self.max_model_len / self.block_size)
        num_blocks = memory // self.block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory: a budget of {memory} bytes holds no KV block "
                f"(one block of {self.block_size} tokens needs {self.block_bytes} bytes)"
            )
        return num_blocks

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def execute(self, step: RunnerStep) -> ModelRunnerOutput:
        """Runs one step. With the native decoder the step's torch work (sampling) runs on
        one thread, so torch's OpenMP threads never spin on the cores the decoder's pool needs
        (kernels/threads.py)."""
        if self.native is None:
            return self._execute(step)
        with pool_owns_the_cores():
            return self._execute(step)

    def _execute(self, step: RunnerStep) -> ModelRunnerOutput:
        for slot in step.finished_slots:
            self.sampling.remove_request(slot)
            self.prompt_scorer.remove(slot)
            self.pooler.remove(slot)
        failed: dict[int, str] = {}  # slot -> why its request ends; the others go on
        for row in step.added:
            try:
                self._add_row(row)
            except Exception as error:
                failed[row.slot] = f"bad sampling state: {type(error).__name__}: {error}"
                self.prompt_scorer.remove(row.slot)
                self.pooler.remove(row.slot)
        plan = step.plan
        self.inputs.apply_new_blocks(
            plan.new_block_slots, plan.new_block_indices, plan.new_block_ids
        )
        if plan.num_tokens == 0:
            return ModelRunnerOutput.empty(failed_slots=failed)
        if self.encoder:  # embeds only: every sampled row's token is never shown
            pooled = encoder_step(self.model, self.pooler, plan, self.device)
            tokens = np.zeros(len(plan.logits_indices), np.int64)
            output = ModelRunnerOutput.empty(failed_slots=failed, pooled=pooled)
            return dataclasses.replace(output, sampled_token_ids=tokens, num_sampled=tokens + 1)
        width = -(-int(np.max(plan.seq_lens)) // self.block_size)
        block_tables = self.inputs.block_tables(np.asarray(plan.slots, np.int64), width)
        native_logits = None  # the native decoder's logits of the sampled rows
        if self.graphs is not None and self.graphs.can_run(plan):
            hidden = self.graphs.run(plan, block_tables)  # (T, hidden), replayed
        elif self.native is not None:
            hidden, native_logits = self.native.forward(
                plan, block_tables, self.kv_caches, plan.logits_indices
            )
        else:
            hidden = self._forward(plan, block_tables, self.kv_caches)  # (T, hidden)
        scored = self._score_prompts(plan, hidden, failed) if self.prompt_scorer else None
        pooled = self.pooler.pool(plan, hidden) if self.pooler else None
        logits_indices = plan.logits_indices
        if len(logits_indices) == 0:  # only partial prefills this step
            if self.draft is not None:  # the draft prefills the same chunks
                self.draft.step(plan, block_tables, StepResult.none(), self.sampling)
            return ModelRunnerOutput.empty(scored, failed, pooled)
        if native_logits is not None:
            logits = native_logits  # (S, vocab)
        else:
            rows = torch.from_numpy(np.asarray(logits_indices, np.int64)).to(self.device)
            logits = self.model.compute_logits(hidden[rows])  # (S, vocab)
        if not self.samples:
            return ModelRunnerOutput.empty()
        slots = np.asarray(plan.slots[plan.sample_request_rows], np.int64)
        banned = (plan.banned_rows, plan.banned_ids) if len(plan.banned_rows) else None
        rules = RowRules(plan.grammar_bitmask(), banned)  # masks computed while the model ran
        groups = sampling_groups(plan.sample_request_rows)  # rows with drafts have several
        drafts = draft_tokens(plan, groups)
        tokens, counts, logprobs, sampling_failed = verify_and_sample(
            self.sampler,
            self.sampling,
            logits,
            slots,
            drafts,
            groups,
            rules,
            self._to_host,
            self.draft.proposals(plan, *groups, drafts) if self.draft is not None else None,
        )
        failed.update(sampling_failed)
        if failed:
            tokens[np.isin(np.repeat(slots[groups[0]], counts), list(failed))] = -1
        proposed = None
        if self.draft is not None:
            settled = StepResult(groups[0], groups[1], counts, tokens)
            proposed = self.draft.step(plan, block_tables, settled, self.sampling)
        return ModelRunnerOutput(
            drafts=proposed,
            sampled_token_ids=tokens,
            num_sampled=counts,
            logprobs=logprobs,
            prompt_logprobs=scored,
            failed_slots=failed,
            pooled=pooled,
        )

    def _score_prompts(self, plan, hidden: torch.Tensor, failed: dict[int, str]):
        """The step's prompt logprobs; when scoring raises, the requests scored this step end
        (recorded in `failed`) and the others go on."""
        scoring = [s for s in np.asarray(plan.slots).tolist() if s in self.prompt_scorer]
        try:
            return self.prompt_scorer.score(plan, hidden, self.model.compute_logits)
        except Exception as error:
            if is_fatal(error):
                raise
            for slot in scoring:
                self.prompt_scorer.remove(slot)
                failed[slot] = f"prompt logprobs failed: {type(error).__name__}: {error}"
            return None

    def _add_row(self, row: NewSamplingRow) -> None:
        if row.prompt_logprobs is not None:
            self.prompt_scorer.add(row.slot, row.prompt_logprobs, row.prompt_token_ids)
        if row.pooling is not None:
            self.pooler.add(row.slot, row.pooling, row.prompt_token_ids)
        self.sampling.add_request(
            row.slot,
            row.params,
            row.prompt_token_ids,
            bad_words_ids=row.bad_words_ids,
        )

    def _forward(
        self, plan: ForwardPlan, block_tables: np.ndarray, kv_caches: list[KVCache] | None
    ) -> torch.Tensor:
        """plan: a step's plan or a one-off forward's arrays; block_tables (R, W)."""
        if self.native is not None and kv_caches is not None:
            return self.native.forward(plan, block_tables, kv_caches)[0]
        input_ids, positions, slot_mapping = self.inputs.write(
            plan.input_ids, plan.positions, plan.slot_mapping
        )
        metadata = self.attention.build_metadata(
            AttentionInputs(
                slot_mapping=slot_mapping,
                query_start_loc=np.asarray(plan.query_start_loc),
                num_computed_tokens=np.asarray(plan.num_computed_tokens),
                seq_lens=np.asarray(plan.seq_lens),
                block_tables=block_tables,
                block_size=self.block_size,
            )
        )
        ctx = ForwardContext(self.attention, metadata, kv_caches)
        return self.model(input_ids, positions, ctx)

    def _to_host(self, out: SamplerOutput) -> tuple[np.ndarray, SampledLogprobs]:
        """The step's one wait on the device: sampled ids (and asked-for logprobs) to host."""
        lp = out.logprobs
        if self.device.type != "cuda":
            return out.tokens.numpy(), lp.to_host() if lp else SampledLogprobs.empty()
        tokens = out.tokens.to("cpu", non_blocking=True)
        if lp is not None:
            lp.chosen, lp.top_ids, lp.top_logprobs = (
                t.to("cpu", non_blocking=True) for t in (lp.chosen, lp.top_ids, lp.top_logprobs)
            )
        torch.cuda.current_stream(self.device).synchronize()
        return tokens.numpy(), lp.to_host() if lp else SampledLogprobs.empty()

    # ------------------------------------------------------------------ one-off forwards

    @torch.inference_mode()
    def prompt_logprobs(
        self, token_ids: Sequence[int], chunk_size: int | None = None
    ) -> torch.Tensor:
        """Log-probability of each token given the ones before it, through the same forward as
        serving (one prefill into a scratch KV cache of the engine's cache dtype; with
        `chunk_size`, prefill chunks of that many tokens, each reading the earlier ones from the
        cache): (len(token_ids) - 1,) float32."""
        n = len(token_ids)
        if n < 2:
            raise ValueError(f"scoring needs at least 2 tokens, got {n}")
        context = self.model_config.max_position_embeddings
        if n > context:
            raise ValueError(f"{n} tokens exceed the model's context of {context}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
        num_blocks = math.ceil(n / self.block_size)
        ids = np.asarray(token_ids, dtype=np.int32)
        plan, block_tables = _single_prompt_plan(n, num_blocks, self.block_size)
        plan = dataclasses.replace(plan, input_ids=ids)
        scratch = self.kv_spec.allocate(num_blocks, self.device, self.attention)
        chunk = chunk_size or n
        hidden = torch.cat(
            [
                self._forward(_chunk_of(plan, start, min(start + chunk, n)), block_tables, scratch)
                for start in range(0, n, chunk)
            ]
        )
        logits = self.model.compute_logits(hidden[:-1]).float()
        targets = torch.from_numpy(ids[1:].astype(np.int64)).to(self.device)
        return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0].cpu()

    @torch.inference_mode()
    def _profile_free_memory(self, utilization: float) -> int:
        """Bytes left for the KV cache: utilization * total GPU memory, less what is in use and
        the activation peak of a forward over the step token budget."""
        num_tokens = min(self.max_num_batched_tokens, self.max_model_len)
        num_blocks = math.ceil(num_tokens / self.block_size)
        kv_caches = self.kv_spec.allocate(num_blocks, self.device, self.attention)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        plan, block_tables = _single_prompt_plan(num_tokens, num_blocks, self.block_size)
        self._forward(plan, block_tables, kv_caches)
        torch.cuda.synchronize(self.device)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - before
        del kv_caches
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total * utilization - (total - free) - activation_peak)


def _draft_model(config: EngineConfig) -> DraftModel | None:
    """The draft model of `draft_model` speculation (None for any other configuration)."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model" or spec.model is None:
        return None
    return DraftModel(config)


def _single_prompt_plan(
    num_tokens: int, num_blocks: int, block_size: int
) -> tuple[ForwardArrays, np.ndarray]:
    """A forward of one prompt over blocks 0..num_blocks-1 (scoring, profiling), and its block
    table (1, num_blocks)."""
    positions = np.arange(num_tokens, dtype=np.int32)
    plan = ForwardArrays(
        input_ids=np.zeros(num_tokens, np.int32),
        positions=positions,
        slot_mapping=positions,
        query_start_loc=np.array([0, num_tokens], np.int32),
        num_computed_tokens=np.zeros(1, np.int32),
        seq_lens=np.array([num_tokens], np.int32),
    )
    return plan, np.arange(num_blocks, dtype=np.int32)[None]


def _chunk_of(plan: ForwardArrays, start: int, end: int) -> ForwardArrays:
    """Tokens [start, end) of a one-prompt plan, the ones before them already in the cache."""
    if start == 0 and end == len(plan.input_ids):
        return plan
    return ForwardArrays(
        input_ids=plan.input_ids[start:end],
        positions=plan.positions[start:end],
        slot_mapping=plan.slot_mapping[start:end],
        query_start_loc=np.array([0, end - start], np.int32),
        num_computed_tokens=np.array([start], np.int32),
        seq_lens=np.array([end], np.int32),
    )
