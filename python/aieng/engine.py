"""The engine step loop: the Rust core plans, the model runner computes, the core updates.

One step is a constant number of calls into the core whatever the batch size:
`schedule()`, `SamplingTable.batch()`, `runner.execute()`, `update()`. The Python work
after it is one pass over the requests that received a token, to build their outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from aieng._core import EngineCore, InvalidArgumentError, Tokenizer
from aieng.outputs import CompletionOutput, RequestMetrics, RequestOutput
from aieng.runner import ModelRunner
from aieng.sampling import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    seed: int = 0
    long_prefill_token_threshold: int = 0


@dataclass
class _Sequence:
    """One completion of a request (a request with n > 1 has n of them)."""

    core_id: str
    index: int
    slot: int  # -1 until the sequence is in the core
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0

    def output(self, delta: bool) -> CompletionOutput:
        start_tok = self.sent_tokens if delta else 0
        start_txt = self.sent_text if delta else 0
        logprobs = self.logprobs[start_tok:] if self.logprobs is not None else None
        out = CompletionOutput(
            index=self.index,
            text="".join(self.text[start_txt:]),
            token_ids=self.token_ids[start_tok:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        if delta:
            self.sent_tokens, self.sent_text = len(self.token_ids), len(self.text)
        return out


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    metrics: RequestMetrics
    stream: bool = False
    num_cached_tokens: int = 0
    priority: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def output(self, delta: bool) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.output(delta) for s in self.sequences],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
        )


class LLMEngine:
    """Owns the tokenizer, the model runner and the Rust core; steps them together."""

    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = Path(config.model)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder not found: {model_dir}")
        self.tokenizer = Tokenizer.from_dir(str(model_dir))
        self.runner = ModelRunner(
            model_dir,
            device=None if config.device == "auto" else config.device,
            dtype=_torch_dtype(config.dtype),
            block_size=config.block_size,
            kv_cache_memory=config.kv_cache_memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_batched_tokens=config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_num_seqs=config.max_num_seqs,
            seed=config.seed,
        )
        model_config = self.runner.config
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {model_config.max_position_embeddings}"
            )
        budget = config.max_num_batched_tokens or max(
            DEFAULT_MAX_NUM_BATCHED_TOKENS, config.max_num_seqs
        )
        self.core = EngineCore(
            num_blocks=self.runner.num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            tokenizer=self.tokenizer,
        )
        self.eos_token_ids = sorted(
            set(self.tokenizer.eos_token_ids) | set(model_config.eos_token_ids)
        )
        self.sampling = self.runner.new_sampling_table(capacity=max(64, config.max_num_seqs))
        self.requests: dict[str, _Request] = {}
        self._by_core_id: dict[str, tuple[_Request, _Sequence]] = {}
        self._unscheduled: set[str] = set()  # core ids not yet in any step
        # Requests with n > 1 whose siblings wait for the first sequence's prefill, so that
        # they find the prompt's KV blocks in the prefix cache instead of computing them again.
        self._waiting_siblings: dict[str, _Request] = {}
        self.last_step_num_tokens = 0
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt)
        vocab = self.runner.config.vocab_size
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise InvalidArgumentError(
                f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})"
            )
        return None, [int(t) for t in ids]

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        stream: bool = False,
    ) -> None:
        """Queues a request; with `stream`, every step that changes it returns its delta."""
        if request_id in self.requests:
            raise InvalidArgumentError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        metrics = RequestMetrics(arrival_time=time.monotonic())
        request = _Request(request_id, text, ids, [], metrics, stream=stream)
        for index in range(params.n):
            core_id = request_id if params.n == 1 else f"{request_id}#{index}"
            seq_params = params
            if index and params.seed is not None:  # siblings draw different samples
                seq_params = dataclasses.replace(params, seed=params.seed + index)
            seq = _Sequence(core_id, index, -1, seq_params)
            if params.logprobs is not None:
                seq.logprobs = []
            request.sequences.append(seq)
        share_prompt = params.n > 1 and self.config.enable_prefix_caching
        try:
            for seq in request.sequences[:1] if share_prompt else request.sequences:
                self._add_sequence(request, seq, priority)
        except Exception:
            for seq in request.sequences:
                if seq.slot >= 0:
                    self.core.abort(seq.core_id)
                    self.sampling.remove_request(seq.slot)
                    self._by_core_id.pop(seq.core_id, None)
                    self._unscheduled.discard(seq.core_id)
            raise
        if share_prompt:
            self._waiting_siblings[request_id] = request
        request.priority = priority
        self.requests[request_id] = request

    def _add_sequence(self, request: _Request, seq: _Sequence, priority: int) -> None:
        params = seq.params
        seq.slot = self.core.add_request(
            seq.core_id,
            request.prompt_token_ids,
            max_tokens=params.max_tokens,
            min_tokens=params.min_tokens,
            ignore_eos=params.ignore_eos,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=params.stop_token_ids or [],
            priority=priority,
            stop=params.stop or [],
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        self.sampling.add_request(
            seq.slot, params, request.prompt_token_ids, eos_token_ids=self.eos_token_ids
        )
        self._by_core_id[seq.core_id] = (request, seq)
        self._unscheduled.add(seq.core_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request now; returns its last output (a delta when it streams), or None."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._waiting_siblings.pop(request_id, None)
        for seq in request.sequences:
            self._unscheduled.discard(seq.core_id)
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
                if seq.slot >= 0:
                    self.core.abort(seq.core_id)
                    self.sampling.remove_request(seq.slot)
            self._by_core_id.pop(seq.core_id, None)
        request.metrics.finished_time = time.monotonic()
        return request.output(delta=request.stream)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Runs one engine step. Returns the full output of every request that finished
        and the delta of every streaming request that changed."""
        plan = self.core.schedule()
        self.last_step_num_tokens = plan.num_tokens
        if plan.num_tokens == 0:
            if self.core.has_unfinished():
                raise RuntimeError("the scheduler produced an empty step with requests left")
            return []
        if self._unscheduled:
            now = time.monotonic()
            for core_id in self._unscheduled.intersection(plan.request_ids):
                self._unscheduled.discard(core_id)
                request, _ = self._by_core_id[core_id]
                if request.metrics.first_scheduled_time is None:
                    request.metrics.first_scheduled_time = now
                    request.num_cached_tokens = self.core.num_cached_tokens(core_id) or 0
        batch = self.sampling.batch(plan)
        tokens, logprobs = self.runner.execute(plan, batch)
        self.sampling.append_tokens(batch, tokens)
        out = self.core.update(tokens)
        return self._process(plan, out, logprobs)

    def _process(self, plan, out, logprobs) -> list[RequestOutput]:
        now = time.monotonic()
        sample_of_row = np.full(plan.num_requests, -1, dtype=np.int64)
        sample_of_row[plan.sample_request_rows] = np.arange(len(plan.sample_request_rows))
        changed: dict[str, _Request] = {}
        for row, token, text in zip(
            out.rows.tolist(), out.token_ids.tolist(), out.texts, strict=True
        ):
            request, seq = self._by_core_id[plan.request_ids[row]]
            seq.token_ids.append(token)
            if text:
                seq.text.append(text)
            s = int(sample_of_row[row])
            seq.cumulative_logprob += float(logprobs.chosen[s])
            if seq.logprobs is not None:
                k = int(logprobs.num_top[s])
                top = dict(
                    zip(
                        logprobs.top_ids[s, :k].tolist(),
                        logprobs.top_logprobs[s, :k].tolist(),
                        strict=True,
                    )
                )
                top[token] = float(logprobs.chosen[s])
                seq.logprobs.append(top)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.num_output_tokens += 1
            changed[request.request_id] = request
        if self._waiting_siblings:
            self._add_waiting_siblings(changed)
        for done in out.finished:
            request, seq = self._by_core_id.pop(done.request_id)
            seq.finish_reason = done.finish_reason
            seq.stop_reason = done.stop_reason
            self.sampling.remove_request(seq.slot)
            changed[request.request_id] = request
        results = []
        for request in changed.values():
            if request.finished:
                request.metrics.finished_time = now
                self.requests.pop(request.request_id, None)
            if request.stream or request.finished:
                results.append(request.output(delta=request.stream))
        return results

    def _add_waiting_siblings(self, changed: dict[str, _Request]) -> None:
        """Siblings join once the first sequence's prompt blocks are computed and cached."""
        for request_id in [r for r in self._waiting_siblings if r in changed]:
            request = self._waiting_siblings.pop(request_id)
            for seq in request.sequences[1:]:
                self._add_sequence(request, seq, request.priority)

    def check_pool_whole(self) -> None:
        """Raises unless every KV block is free or evictable and the invariants hold."""
        self.core.check_invariants()
        stats = self.core.stats()["pool"]
        if self.requests or stats["num_free_blocks"] != stats["num_blocks"]:
            raise AssertionError(f"engine not idle: {len(self.requests)} requests, {stats}")


def _torch_dtype(name: str):
    import torch

    if name == "auto":
        return None
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(table)}, got {name!r}")
    return table[name]
