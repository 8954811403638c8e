"""The engine step loop: the Rust core plans, the model runner computes, the core updates.

One step is a constant number of calls into the core whatever the batch size: `schedule()`,
one `RunnerStep` to the runner (the plan, plus the sampling rows added and finished since the
last step), `update()`. The Python work after it is one pass over the tokens the step produced.

A step that raises inside the runner finishes only its own requests (finish reason "error",
logged with their ids) and leaves the engine serving; only a failure that leaves the device
unusable is fatal (`dead_reason` says why, and every later call raises `EngineDeadError`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from aieng._core import EngineCore, Grammar, GrammarCompiler, InvalidArgumentError, Tokenizer
from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import EngineConfig, check_model_folder, create_engine_config
from aieng.engine.engine_client import EngineStats, ModelInfo
from aieng.errors import invalid_field, is_fatal
from aieng.executor import make_executor
from aieng.executor.multiproc import run_as_launched_worker
from aieng.outputs import CompletionOutput, RequestMetrics, RequestOutput
from aieng.pooling import PoolingParams
from aieng.sampling import SamplingParams
from aieng.spec_decode.drafts import SpeculativeDecoding
from aieng.spec_decode.proposer import ProposalRequest
from aieng.worker.runner_io import (
    ModelRunnerOutput,
    NewSamplingRow,
    PooledEmbeddings,
    PromptLogprobs,
    RunnerStep,
)
from aieng.worker.worker import WorkerInfo

logger = logging.getLogger(__name__)

# A front end started by a launcher (torchrun) as a tensor-parallel rank > 0 serves as that
# rank's worker instead: run_as_launched_worker(args) -> its exit status, or None elsewhere.
__all__ = ["EngineDeadError", "LLMEngine", "run_as_launched_worker"]


NO_VALID_TOKEN = "the model produced no valid token (NaN or fully masked logits)"
# An embedding request is a prefill-only one: the core's one sampled token is never shown.
EMBEDDING_SAMPLING = SamplingParams(max_tokens=0, temperature=0.0)


class EngineDeadError(RuntimeError):
    """The engine stopped serving: a failure left its device unusable, or its loop ended."""


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
    cumulative_logprob: float | None = None  # with logprobs only, as in vLLM
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
    client: str | None = None  # who sent it: clients share each step's prefill budget fairly
    grammar: Grammar | None = None  # each sequence gets its own matcher of it
    # With params.prompt_logprobs: per prompt position, filled as the prefill computes it.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    pooling: PoolingParams | None = None  # an embedding request
    embedding: np.ndarray | None = None  # (hidden,) float32, once its prompt is pooled

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
            prompt_logprobs=self.prompt_logprobs,
            embedding=self.embedding,
        )


def _model_info(config: EngineConfig, worker: WorkerInfo, num_blocks: int) -> ModelInfo:
    return ModelInfo(
        model_path=config.model_path,
        architecture=config.model.architecture,
        vocab_size=config.model.vocab_size,
        max_model_len=config.scheduler.max_model_len,
        eos_token_ids=config.eos_token_ids,
        device=worker.device,
        dtype=config.dtype,
        kv_cache_dtype=worker.kv_cache_dtype,
        block_size=config.cache.block_size,
        num_blocks=num_blocks,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        tensor_parallel_size=config.parallel.tensor_parallel_size,
        generation_defaults=dict(config.model.generation_defaults),
        load_phases=worker.load_phases,
        kernels=worker.kernels,
        pooling=config.pooling,
        hidden_size=config.model.hidden_size,
        is_encoder=config.model.is_encoder,
    )


def _tokenizer_of(args: EngineArgs) -> Tokenizer:
    return Tokenizer.from_dir(str(check_model_folder(args)))


class LLMEngine:
    """Owns the tokenizer, the model runner and the Rust core; steps them together."""

    def __init__(self, args: EngineArgs | EngineConfig):
        """args: the options (resolved here, once, by create_engine_config), or a config
        already resolved."""
        if isinstance(args, EngineConfig):
            self.engine_config = args
            self.tokenizer = Tokenizer.from_dir(args.model_path)
        else:
            self.tokenizer = _tokenizer_of(args)
            self.engine_config = create_engine_config(args, self.tokenizer)
        resolved = self.engine_config
        self.vocab_size = resolved.model.vocab_size
        self.eos_token_ids = list(resolved.eos_token_ids)
        self.max_model_len = resolved.scheduler.max_model_len
        self.executor = make_executor(resolved, on_failure=self._runner_failed)
        try:
            memory = self.executor.determine_available_memory()
            num_blocks = self.executor.num_blocks_for(memory)
            worker_info = self.executor.initialize_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.core = EngineCore(
            num_blocks=num_blocks,
            block_size=resolved.cache.block_size,
            max_num_seqs=resolved.scheduler.max_num_seqs,
            max_num_batched_tokens=resolved.scheduler.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=resolved.cache.enable_prefix_caching,
            long_prefill_token_threshold=resolved.scheduler.long_prefill_token_threshold,
            tokenizer=self.tokenizer,
            shared_step_ms=resolved.scheduler.shared_step_ms,
        )
        self.model_info = _model_info(resolved, worker_info, num_blocks)
        spec = resolved.speculative
        self.speculation = SpeculativeDecoding(spec, resolved.device) if spec is not None else None
        self.requests: dict[str, _Request] = {}
        self._by_core_id: dict[str, tuple[_Request, _Sequence]] = {}
        self._by_slot: dict[int, tuple[_Request, _Sequence]] = {}
        self._unscheduled: set[int] = set()  # slots not yet in any step
        self._slot_seconds = np.zeros(0)  # step time charged to each slot (_charge_step)
        # Sampling rows the runner learns of with the next step.
        self._added: list[NewSamplingRow] = []
        self._finished_slots: list[int] = []
        # Requests with n > 1 whose siblings wait for the first sequence's prefill, so that
        # they find the prompt's KV blocks in the prefix cache instead of computing them again.
        self._waiting_siblings: dict[str, _Request] = {}
        self.last_step_num_tokens = 0
        self.dead_reason: str | None = None
        self._ids = itertools.count()
        self._grammar_compiler: GrammarCompiler | None = None  # built on first use
        self._grammar_lock = threading.Lock()

    # ------------------------------------------------------------------ requests

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            if ids and max(ids) >= self.vocab_size:  # a tokenizer larger than the model
                raise InvalidArgumentError(
                    f"prompt: the tokenizer gave token id {max(ids)}, outside the model's "
                    f"vocabulary [0, {self.vocab_size})"
                )
            return prompt, ids
        ids = list(prompt)
        bad = [
            t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise InvalidArgumentError(
                f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})"
            )
        return None, [int(t) for t in ids]

    def compile_grammar(self, params: SamplingParams) -> Grammar | None:
        """The compiled constraint of `params.structured_outputs` (cached in the core; safe to
        call from any thread, the GIL released while compiling). An invalid schema, regex or
        grammar raises InvalidArgumentError naming the problem."""
        constraint = params.structured_outputs
        if constraint is None:
            return None
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
            compiler = self._grammar_compiler
        return compiler.compile(constraint.kind, constraint.source())

    def _bad_words_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word as the token ids it has written alone and after a space (vLLM's
        reading), without special tokens; ids past the model's vocabulary cannot be drawn."""
        words: list[list[int]] = []
        for word in params.bad_words or ():
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and max(ids) < self.vocab_size and ids not in words:
                    words.append(ids)
        return words

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        stream: bool = False,
        client: str | None = None,
    ) -> None:
        """Queues a request; with `stream`, every step that changes it returns its delta.
        With PoolingParams it embeds: its finished output carries `embedding`. `client` names
        who sent it: while several clients have requests, each step's prefill budget is split
        fairly between them (None: the library's one client)."""
        self._check_alive()
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None:
            params = EMBEDDING_SAMPLING
        elif self.engine_config.model.embeds_only:
            raise invalid_field(
                "model",
                f"{self.engine_config.model.architecture} has no LM head: it embeds "
                "(PoolingParams), it cannot generate",
            )
        assert isinstance(params, SamplingParams)
        if request_id in self.requests:
            raise InvalidArgumentError(f"request id {request_id!r} is already in use")
        params.verify(self.vocab_size, self.engine_config.max_logprobs)
        one_token_bad_words = [w[0] for w in self._bad_words_ids(params) if len(w) == 1]
        grammar = self.compile_grammar(params)
        params.check_satisfiable(self.eos_token_ids, one_token_bad_words, grammar)
        text, ids = self.tokenize(prompt)
        metrics = RequestMetrics(arrival_time=time.monotonic())
        request = _Request(request_id, text, ids, [], metrics, stream=stream, grammar=grammar)
        request.pooling = pooling
        request.client = client
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(ids)
        for index in range(params.n):
            core_id = request_id if params.n == 1 else f"{request_id}#{index}"
            seq_params = params
            if index and params.seed is not None:  # siblings draw different samples
                seq_params = dataclasses.replace(params, seed=params.seed + index)
            seq = _Sequence(core_id, index, -1, seq_params)
            if params.logprobs is not None:
                seq.logprobs = []
                seq.cumulative_logprob = 0.0
            request.sequences.append(seq)
        share_prompt = params.n > 1 and self.engine_config.cache.enable_prefix_caching
        try:
            for seq in request.sequences[:1] if share_prompt else request.sequences:
                self._add_sequence(request, seq, priority)
        except Exception:
            for seq in request.sequences:
                if seq.slot >= 0:
                    self._drop_sequence(seq)
            raise
        if share_prompt:
            self._waiting_siblings[request_id] = request
        request.priority = priority
        self.requests[request_id] = request

    def _add_sequence(self, request: _Request, seq: _Sequence, priority: int) -> None:
        params = seq.params
        # The first sequence scores the prompt: it must compute every prompt token itself.
        score_prompt = params.prompt_logprobs if seq.index == 0 else None
        seq.slot = self.core.add_request(
            seq.core_id,
            request.prompt_token_ids,
            # max_tokens 0 (score the prompt only): the core samples one token, never shown.
            max_tokens=max(1, params.max_tokens),
            min_tokens=params.min_tokens,
            ignore_eos=params.ignore_eos,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=params.stop_token_ids or [],
            priority=priority,
            stop=params.stop or [],
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            grammar=request.grammar,
            skip_prefix_cache=score_prompt is not None or request.pooling is not None,
            client=request.client,
        )
        self._added.append(
            NewSamplingRow(
                seq.slot,
                params,
                request.prompt_token_ids,
                self._bad_words_ids(params),
                prompt_logprobs=score_prompt,
                pooling=request.pooling,
            )
        )
        self._by_core_id[seq.core_id] = (request, seq)
        self._by_slot[seq.slot] = (request, seq)
        self._unscheduled.add(seq.slot)

    def _drop_sequence(self, seq: _Sequence) -> None:
        """Takes a live sequence out of the core and the runner's sampling rows."""
        self.core.abort(seq.core_id)
        # A row the runner has not seen yet is withdrawn, not removed after the runner adds it
        # (the runner applies removals first: the row would outlive its sequence and serve the
        # slot's next one). A pending row at this slot is always this sequence's own.
        pending = [row for row in self._added if row.slot == seq.slot]
        if pending:
            self._added.remove(pending[0])
        else:
            self._finished_slots.append(seq.slot)
        self._by_core_id.pop(seq.core_id, None)
        entry = self._by_slot.pop(seq.slot, None)
        if entry is not None:
            self._release_slot(entry[0], seq.slot)
        self._unscheduled.discard(seq.slot)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request now; returns its last output (a delta when it streams), or None."""
        return self._finish_request(request_id, "abort")

    def _finish_request(
        self, request_id: str, reason: str, cause: str | None = None
    ) -> RequestOutput | None:
        """cause: for an "error" finish, what went wrong (becomes the stop_reason)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._waiting_siblings.pop(request_id, None)
        for seq in request.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = reason
                seq.stop_reason = cause
                if seq.core_id in self._by_core_id:
                    self._drop_sequence(seq)
        request.metrics.finished_time = time.monotonic()
        return request.output(delta=request.stream)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        """The core's counters and the pool's state now (call from the thread that steps)."""
        core = self.core.stats()
        pool = core["pool"]
        return EngineStats(
            num_running=core["num_running"],
            num_waiting=core["num_waiting"],
            kv_cache_usage=pool["usage"],
            num_blocks=pool["num_blocks"],
            num_free_blocks=pool["num_free_blocks"],
            num_cached_blocks=pool["num_cached_blocks"],
            prefix_cache_queries=pool["prefix_cache_queries"],
            prefix_cache_hits=pool["prefix_cache_hits"],
            num_preemptions=core["num_preemptions"],
            num_steps=core["num_steps"],
            step_token_budget=core["step_token_budget"],
            num_requests=len(self.requests),
            **self._speculation_stats(),
            kv_cache_dtype=self.model_info.kv_cache_dtype,
            block_size=self.model_info.block_size,
            max_num_seqs=self.model_info.max_num_seqs,
            kernels=self.model_info.kernels,
            heartbeat=time.monotonic(),
        )

    def _speculation_stats(self) -> dict:
        spec = self.speculation
        if spec is None:
            return {}
        return {
            "spec_decode_num_drafts": spec.num_drafts,
            "spec_decode_num_draft_tokens": spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_decode_accepted_per_position": tuple(spec.accepted_per_position.tolist()),
        }

    def gpu_memory(self):
        """Rank 0's GPU memory figures now (aieng.worker.gpu_memory.GpuMemory); None off CUDA."""
        return self.executor.gpu_memory()

    def prompt_logprobs(self, token_ids: Sequence[int], chunk_size: int | None = None):
        """Log-probability of each token given the ones before it, through the serving forward
        on every rank (one prefill into a scratch KV cache; with `chunk_size`, prefill chunks of
        that many tokens): (len(token_ids) - 1,) float32 tensor."""
        self._check_alive()
        return self.executor.prompt_logprobs(token_ids, chunk_size)

    @property
    def runner(self):
        """Rank 0's ModelRunner, in this process: for tests and tools that inspect the model
        or its KV cache. The engine itself goes through `executor`."""
        return self.executor.driver.runner

    def shutdown(self) -> None:
        """Releases every process, thread and group the engine started (its tensor-parallel
        workers) and its device memory (the model, the KV cache, the CUDA graphs) now, not at
        the next garbage collection; later calls raise EngineDeadError. Idempotent."""
        if self.dead_reason is None:
            self.dead_reason = "the engine was shut down"
        self.executor.shutdown()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Runs one engine step. Returns the full output of every request that finished
        and the delta of every streaming request that changed."""
        self._check_alive()
        started = time.monotonic()
        plan = self.core.schedule()
        self.last_step_num_tokens = plan.num_tokens
        step = RunnerStep(plan, self._added, self._finished_slots)
        self._added, self._finished_slots = [], []
        if plan.num_tokens == 0:
            self.executor.execute(step)  # keeps the runner's sampling rows current
            self.core.update(np.zeros(0, np.int64))
            if self.core.has_unfinished():
                raise RuntimeError("the scheduler produced an empty step with requests left")
            return []
        slots = plan.slots
        if self._unscheduled:
            self._mark_scheduled(slots)
        try:
            result = self.executor.execute(step)
        except Exception as error:
            outputs = self._fail_step(plan, error)
            # Rows of live requests the runner may not have applied before it raised.
            self._added[:0] = [row for row in step.added if row.slot in self._by_slot]
            return outputs
        self._charge_step(plan, time.monotonic() - started)
        tokens = result.sampled_token_ids
        failed: list[RequestOutput] = []
        if result.failed_slots or (len(tokens) and tokens.min() < 0):
            failed = self._fail_rows(plan, result)
            tokens = np.where(tokens < 0, 0, tokens)  # their requests are gone from the core
        out = self.core.update(tokens, result.num_sampled)
        if self.speculation is not None:
            self._record_speculation(plan, result)
            self.speculation.receive(result.drafts)
        outputs = failed + self._process(plan, out, result)
        if self.speculation is not None and self.speculation.wanted(self.core.num_running):
            self._propose(np.unique(out.slots))
        return outputs

    def _record_speculation(self, plan, result: ModelRunnerOutput) -> None:
        rows = np.unique(plan.sample_request_rows)
        live = (self._by_slot.get(slot) for slot in plan.slots[rows].tolist())
        ids = [entry[1].core_id if entry is not None else "" for entry in live]
        self.speculation.record(plan.sample_request_rows, result.num_sampled, ids)

    def _propose(self, slots: np.ndarray) -> None:
        """Drafts for the live sequences that took tokens this step, at most as many as its
        max_tokens leave after the next token (the core keeps a grammar request's draft only as
        far as its grammar allows)."""
        asked: list[tuple[_Sequence, ProposalRequest]] = []
        for slot in slots.tolist():
            entry = self._by_slot.get(slot)
            if entry is None:
                continue
            request, seq = entry
            room = seq.params.max_tokens - len(seq.token_ids) - 1
            if room > 0:
                tokens = np.array(request.prompt_token_ids + seq.token_ids, np.int64)
                asked.append((seq, ProposalRequest(seq.core_id, tokens, room, slot)))
        drafts = self.speculation.propose([p for _, p in asked]) if asked else []
        for (seq, _), draft in zip(asked, drafts, strict=True):
            if draft:
                self.core.set_draft(seq.core_id, draft)

    def _charge_step(self, plan, seconds: float) -> None:
        """Splits a step's wall time over its requests by scheduled tokens (per slot, in
        numpy); a slot's total moves to its request's metrics when the slot is released."""
        slots = np.asarray(plan.slots, dtype=np.int64)
        tokens = np.diff(np.asarray(plan.query_start_loc, dtype=np.float64))
        if not len(slots) or tokens.sum() <= 0:
            return
        if len(self._slot_seconds) <= slots.max():
            grown = np.zeros(max(int(slots.max()) + 1, 2 * len(self._slot_seconds)))
            grown[: len(self._slot_seconds)] = self._slot_seconds
            self._slot_seconds = grown
        np.add.at(self._slot_seconds, slots, seconds * tokens / tokens.sum())

    def _release_slot(self, request: _Request, slot: int) -> None:
        """The slot's charged step time goes to its request (a slot is reused after this)."""
        if slot < len(self._slot_seconds):
            request.metrics.engine_seconds += float(self._slot_seconds[slot])
            self._slot_seconds[slot] = 0.0

    def _mark_scheduled(self, slots: np.ndarray) -> None:
        now = time.monotonic()
        for slot in self._unscheduled.intersection(slots.tolist()):
            self._unscheduled.discard(slot)
            request, seq = self._by_slot[slot]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
                request.metrics.first_step_token_budget = self.core.step_token_budget
                request.num_cached_tokens = self.core.num_cached_tokens(seq.core_id) or 0

    def _fail_step(self, plan, error: Exception) -> list[RequestOutput]:
        """The runner raised: end this step's requests with an error, keep the engine."""
        message = f"{type(error).__name__}: {error}"
        if is_fatal(error):
            self.dead_reason = message
            logger.error("engine step failed; the device is unusable: %s", message)
            raise EngineDeadError(message) from error
        request_ids = sorted({self._by_slot[s][0].request_id for s in plan.slots.tolist()})
        logger.error(
            "engine step failed, finishing its requests %s with an error: %s",
            ", ".join(request_ids),
            message,
            exc_info=error,
        )
        outputs = [self._finish_request(rid, "error", message) for rid in request_ids]
        sampling = len(np.unique(plan.sample_request_rows))
        self.core.update(np.zeros(sampling, np.int64))  # closes the step
        return [o for o in outputs if o is not None]

    def _fail_rows(self, plan, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Rows that failed on their own end their requests with an error; the step's other
        requests go on. A sampled row without a recorded cause had no valid token."""
        causes = dict(result.failed_slots)
        token_rows = np.repeat(np.unique(plan.sample_request_rows), result.num_sampled)
        rows = token_rows[result.sampled_token_ids < 0]
        for slot in plan.slots[rows].tolist():
            causes.setdefault(int(slot), NO_VALID_TOKEN)
        by_request: dict[str, str] = {}
        for slot, cause in causes.items():
            entry = self._by_slot.get(slot)
            if entry is not None:
                by_request.setdefault(entry[0].request_id, cause)
        for request_id, cause in sorted(by_request.items()):
            logger.error("request %s failed: %s", request_id, cause)
        outputs = [self._finish_request(rid, "error", cause) for rid, cause in by_request.items()]
        return [o for o in outputs if o is not None]

    def _record_prompt_logprobs(self, scored: PromptLogprobs) -> None:
        for i, (slot, position) in enumerate(
            zip(scored.slots.tolist(), scored.positions.tolist(), strict=True)
        ):
            entry = self._by_slot.get(slot)
            if entry is None or entry[0].prompt_logprobs is None:
                continue
            request = entry[0]
            k = int(scored.num_top[i])
            ids, values = scored.top_ids[i, :k].tolist(), scored.top_logprobs[i, :k].tolist()
            top = dict(zip(ids, values, strict=True))
            top[request.prompt_token_ids[position + 1]] = float(scored.chosen[i])
            request.prompt_logprobs[position + 1] = top

    def _record_embeddings(self, pooled: PooledEmbeddings) -> None:
        for slot, vector in zip(pooled.slots.tolist(), pooled.vectors, strict=True):
            entry = self._by_slot.get(slot)
            if entry is not None:
                entry[0].embedding = vector

    def _process(self, plan, out, result: ModelRunnerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        if result.prompt_logprobs is not None:
            self._record_prompt_logprobs(result.prompt_logprobs)
        if result.pooled is not None:
            self._record_embeddings(result.pooled)
        logprobs = result.logprobs
        # Logprobs by flat token index; a row's tokens start at first_token[row].
        logprob_of_token: dict[int, int] = {}
        first_token: dict[int, int] = {}
        if len(logprobs.rows):
            logprob_of_token = {int(t): i for i, t in enumerate(logprobs.rows.tolist())}
            starts = np.r_[0, np.cumsum(result.num_sampled)[:-1]].tolist()
            first_token = dict(
                zip(np.unique(plan.sample_request_rows).tolist(), starts, strict=True)
            )
        changed: dict[str, _Request] = {}
        last_row, taken = -1, 0
        for row, slot, token, text in zip(
            out.rows.tolist(), out.slots.tolist(), out.token_ids.tolist(), out.texts, strict=True
        ):
            entry = self._by_slot.get(slot)
            if entry is None:
                continue
            request, seq = entry
            if seq.params.max_tokens == 0:  # the core's one token is not part of the output
                changed[request.request_id] = request
                continue
            seq.token_ids.append(token)
            if text:
                seq.text.append(text)
            taken = 0 if row != last_row else taken + 1
            last_row = row
            if seq.logprobs is not None:
                i = logprob_of_token.get(first_token[row] + taken, -1) if row in first_token else -1
                top: dict[int, float] = {}
                if i >= 0:
                    k = int(logprobs.num_top[i])
                    ids, values = logprobs.top_ids[i, :k].tolist(), logprobs.top_logprobs[i, :k]
                    top = dict(zip(ids, values.tolist(), strict=True))
                    chosen = float(logprobs.chosen[i])
                    top[token] = chosen
                    seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + chosen
                seq.logprobs.append(top)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.num_output_tokens += 1
            changed[request.request_id] = request
        for done in out.finished:
            entry = self._by_core_id.pop(done.request_id, None)
            if entry is None:
                continue
            request, seq = entry
            self._by_slot.pop(seq.slot, None)
            self._release_slot(request, seq.slot)
            self._finished_slots.append(seq.slot)
            seq.finish_reason = done.finish_reason
            seq.stop_reason = done.stop_reason
            if seq.params.max_tokens == 0:
                seq.finish_reason, seq.stop_reason = "length", None
            changed[request.request_id] = request
        # After the finished sequences let go of their slots: a sibling may take one of them.
        if self._waiting_siblings:
            self._add_waiting_siblings(changed)
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

    def _runner_failed(self, reason: str) -> None:
        """A tensor-parallel worker died between steps (called from the runner's watcher
        thread): the engine is dead, and says why."""
        self.dead_reason = reason

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_reason}")

    def check_pool_whole(self) -> None:
        """Raises unless every KV block is free or evictable and the invariants hold."""
        self.core.check_invariants()
        stats = self.core.stats()["pool"]
        if self.requests or stats["num_free_blocks"] != stats["num_blocks"]:
            raise AssertionError(f"engine not idle: {len(self.requests)} requests, {stats}")
