"""One HTTP generation request end to end: admission, the engine requests of its prompts,
their merged deltas, timeouts, client disconnects, and the accounting when it ends.

Choice `i * n + j` is completion `j` of prompt `i`, as in OpenAI's batched completions.

A choice the engine finishes with finish_reason "error" (its step failed; the engine goes on)
fails the whole request with a 500 `server_error` naming the request id and the cause: as the
status of a response not yet started, else as an error event in the stream, which OpenAI's
clients raise as an `APIError` (they retry a 500 status on their own). What else still runs
of the request is aborted. A choice that ended because no token could be drawn (the request's
own masks left none) is a 400 `no_valid_token` instead: retrying cannot help.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
from fastapi import Request

from aieng.engine.engine_client import EngineClient
from aieng.engine.llm_engine import NO_VALID_TOKEN, EngineDeadError
from aieng.engine.within import within
from aieng.errors import AiengError, InvalidArgumentError, error_field
from aieng.outputs import RequestMetrics, RequestOutput
from aieng.pooling import PoolingParams
from aieng.sampling import SamplingParams
from aieng.server.admission import ServerState
from aieng.server.clients import client_of, fair_share_key
from aieng.server.context import ServerContext, arrival_of, request_id_of
from aieng.server.errors import ApiError, internal_error
from aieng.server.request_log import RequestRecord, debug_stages, log_request
from aieng.server.stages import mark, stage_times

logger = logging.getLogger(__name__)


@dataclass
class Delta:
    """What one step added to one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


class Generation:
    def __init__(
        self,
        ctx: ServerContext,
        http: Request,
        engine: EngineClient,
        prompts: list[list[int]],
        params: list[SamplingParams] | list[PoolingParams],
        field_names: dict[str, str] | None = None,
    ):
        """field_names: the request's own name of an engine-checked field, where the route
        names it differently (chat's `top_logprobs` is the engine's `logprobs`)."""
        self.ctx, self.http, self.endpoint, self.engine = ctx, http, http.url.path, engine
        self.field_names = field_names or {}
        self.request_id = request_id_of(http)
        self.client = client_of(http)
        self.arrival = arrival_of(http)
        self.created = int(time.time())
        self.prompts, self.params = prompts, params
        self.n = params[0].n if isinstance(params[0], SamplingParams) else 1
        self.choices = [Choice() for _ in range(len(prompts) * self.n)]
        for i, p in enumerate(params):
            if isinstance(p, SamplingParams) and p.logprobs is not None:
                for choice in self.choices[i * self.n : (i + 1) * self.n]:
                    choice.logprobs = []
        self.engine_ids = [ctx.new_engine_id() for _ in prompts]
        self.cached_tokens = 0
        # Per prompt, with SamplingParams.prompt_logprobs: RequestOutput.prompt_logprobs.
        self.prompt_logprobs: list[list[dict[int, float] | None] | None] = [None] * len(prompts)
        # Per prompt, with PoolingParams: RequestOutput.embedding.
        self.embeddings: list[np.ndarray | None] = [None] * len(prompts)
        self.engine_seconds = 0.0  # the prompts' shares of engine step time (cost)
        # the least token budget of the steps that first scheduled the prompts (first output:
        # a stream its client leaves early still has it; finished: every prompt's)
        self.step_budget: int | None = None
        self.queue_time: float | None = None
        self.first_output: float | None = None
        self.last_output: float | None = None
        self.status = 200
        self.error: str | None = None
        self._last_output_of: dict[int, float] = {}  # prompt index -> time of its last tokens
        self._events: asyncio.Queue = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self._open = len(prompts)
        self._admitted = False
        self._closed = False
        self.done = asyncio.Event()  # set once the request is over (shadow comparisons wait)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Admits the request (or raises 400/429/503) and hands its prompts to the engine."""
        mark(self.http.scope, "prepared")  # parsed, templated and tokenized
        self._check_satisfiable()
        admission, metrics = self.ctx.admission, self.ctx.metrics
        refusal = admission.refusal([len(p) for p in self.prompts], self.client)
        if refusal is not None:
            metrics.rejected(refusal.reason)
            self.status, self.error = refusal.status, refusal.reason
            self._log()
            # a request that could never be queued names its prompts' field
            param = self.field_names.get("prompt", "prompt") if refusal.status == 400 else None
            raise ApiError(refusal.status, refusal.message, param, refusal.reason, refusal.headers)
        timeout = self.ctx.config.request_timeout
        deadline = None if timeout is None else self.arrival + timeout
        for index, (engine_id, prompt) in enumerate(
            zip(self.engine_ids, self.prompts, strict=True)
        ):
            admission.admit(engine_id, len(prompt), self.client)
            metrics.admitted(len(prompt))
            self._pumps.append(asyncio.create_task(self._pump(index, engine_id, deadline)))
        self._admitted = True
        self.ctx.after_admitted(self)

    def _check_satisfiable(self) -> None:
        """A 400 at the door for a request that could never draw a token (SamplingParams'
        rule; the engine applies it again, with the bad words, when it takes the request)."""
        eos = self.engine.model_info.eos_token_ids
        for params in self.params:
            if not isinstance(params, SamplingParams):
                continue
            try:
                params.check_satisfiable(eos)
            except InvalidArgumentError as error:
                api_error = self._api_error(error)
                self.status, self.error = api_error.status, api_error.code
                self._log()
                raise api_error from None

    async def _pump(self, index: int, engine_id: str, deadline: float | None) -> None:
        """Waits for the prompt's fair turn to go to the engine (at most until the deadline),
        then hands on its outputs."""
        prompt, params = self.prompts[index], self.params[index]
        try:
            kind = "embed" if isinstance(params, PoolingParams) else "generate"
            turn = (self.engine, engine_id, kind, self.client, len(prompt))
            if not self.ctx.admission.try_enter(*turn):
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    await within(self.ctx.admission.enter(*turn), wait)
                except TimeoutError:
                    raise self._aborted_error() from None
            mark(self.http.scope, "gate")
            stream = self.engine.generate(
                engine_id, prompt, params, deadline=deadline, client=fair_share_key(self.client)
            )
            async for out in stream:
                self._events.put_nowait((index, out))
        except Exception as error:
            self._events.put_nowait((index, error))
        finally:
            self.ctx.admission.done(engine_id)
            self._events.put_nowait((index, None))

    def close(self) -> None:
        """Aborts what still runs (a no-op for finished requests) and does the accounting."""
        if self._closed:
            return
        self._closed = True
        for engine_id, task in zip(self.engine_ids, self._pumps, strict=False):
            if not task.done():
                self.engine.abort(engine_id)
                task.cancel()
        if self._admitted:
            self._account()
        self._log()
        self.done.set()

    # ------------------------------------------------------------------ deltas

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """The deltas of each engine output, merged over prompts, until all have finished."""
        while self._open:
            index, item = await self._events.get()
            if item is None:
                self._open -= 1
                continue
            if isinstance(item, Exception):
                raise self._api_error(item)
            deltas = self._apply(index, item)
            failed = next((d for d in deltas if d.finish_reason == "error"), None)
            if failed is not None:
                raise self._step_failed(index, self.choices[failed.index])
            if deltas:
                yield deltas

    async def first_deltas(self) -> list[Delta]:
        """Waits, watching for a disconnect, until there is something to send: output, or a
        finish other than an abort. A request that ends with nothing raises its error status."""
        buffered: list[Delta] = []
        self._iterator = self.deltas().__aiter__()

        async def first() -> None:
            async for deltas in self._iterator:
                buffered.extend(deltas)
                if any(d.token_ids or d.finish_reason not in (None, "abort") for d in deltas):
                    return

        await self._or_disconnect(first())
        if not any(c.token_ids for c in self.choices) and all(
            c.finish_reason == "abort" for c in self.choices
        ):
            raise self._aborted_error()
        return buffered

    async def remaining_deltas(self) -> AsyncIterator[list[Delta]]:
        async for deltas in self._iterator:
            yield deltas

    async def collect(self) -> None:
        """Runs every choice to its end (non-streaming), watching for a disconnect."""
        await self.first_deltas()

        async def rest() -> None:
            async for _ in self.remaining_deltas():
                pass

        await self._or_disconnect(rest())

    def _apply(self, index: int, out: RequestOutput) -> list[Delta]:
        now = time.monotonic()
        self.ctx.admission.started(self.engine_ids[index])
        if self.first_output is None:
            self.first_output = now
            mark(self.http.scope, "delivered", now)
            if out.metrics is not None:
                self._mark_engine_stages(out.metrics, now)
                self.queue_time = out.metrics.queue_time
                self._note_step_budget(out.metrics.first_step_token_budget)
        if any(c.token_ids for c in out.outputs):
            previous = self._last_output_of.get(index)
            if previous is not None:
                self.ctx.metrics.inter_token(now - previous)
            self._last_output_of[index] = self.last_output = now
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[index] = out.prompt_logprobs
        if out.embedding is not None:
            self.embeddings[index] = out.embedding
        if out.finished:
            self.cached_tokens += out.num_cached_tokens
            if out.metrics is not None:
                self.engine_seconds += out.metrics.engine_seconds
                self._note_step_budget(out.metrics.first_step_token_budget)
        deltas = []
        for c in out.outputs:
            choice = self.choices[index * self.n + c.index]
            new_finish = c.finish_reason if choice.finish_reason is None else None
            if not (c.text or c.token_ids or new_finish):
                continue
            choice.text.append(c.text)
            choice.token_ids.extend(c.token_ids)
            if choice.logprobs is not None and c.logprobs is not None:
                choice.logprobs.extend(c.logprobs)
            if new_finish:
                choice.finish_reason, choice.stop_reason = new_finish, c.stop_reason
            logprobs = c.logprobs if choice.logprobs is not None else None
            deltas.append(
                Delta(index * self.n + c.index, c.text, c.token_ids, logprobs, new_finish)
            )
        return deltas

    def _mark_engine_stages(self, metrics: RequestMetrics, now: float) -> None:
        """The engine's own times of the first output: it took the request (`queued`), first
        scheduled it, produced its first token. They are time.monotonic() of the engine's
        thread; an engine in another process on this machine has the same clock, one on
        another machine not (its times, outside this request's span, are left out)."""
        for name, at in (
            ("queued", metrics.arrival_time),
            ("scheduled", metrics.first_scheduled_time),
            ("first_token", metrics.first_token_time),
        ):
            if at is not None and self.arrival <= at <= now:
                mark(self.http.scope, name, at)

    async def _or_disconnect(self, work) -> None:
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_disconnected(self.http))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():  # the client went, or this request was cancelled (Ray Serve)
                task.cancel()
        if task not in done:
            self.status, self.error = 499, "client_disconnected"
            raise ClientGone
        task.result()

    # ------------------------------------------------------------------ errors, accounting

    def _api_error(self, error: Exception) -> ApiError:
        if isinstance(error, ApiError):
            return error
        if isinstance(error, InvalidArgumentError):
            field = error_field(error) or "prompt"  # a field the engine checks, or the prompt
            return ApiError(400, str(error), self.field_names.get(field, field), "invalid_value")
        if isinstance(error, EngineDeadError):
            return ApiError(503, str(error), code="engine_dead")
        if isinstance(error, AiengError):
            return ApiError(500, f"engine error: {error}", code="engine_error")
        logger.error("request %s failed", self.request_id, exc_info=error)
        return internal_error(self.request_id)

    def _step_failed(self, index: int, choice: Choice) -> ApiError:
        cause = choice.stop_reason if isinstance(choice.stop_reason, str) else "see the server log"
        if cause == NO_VALID_TOKEN:  # the request's own masks left nothing: not a server fault
            return ApiError(
                400,
                f"request {self.request_id}: at some step no token could be drawn: the "
                "request's allowed_token_ids, bad_words, structured output and min_tokens "
                "together masked every token (or the logits were not finite)",
                None,
                "no_valid_token",
            )
        return ApiError(
            500,
            f"request {self.request_id} failed in the engine (engine request "
            f"{self.engine_ids[index]}): {cause}",
            code="engine_error",
        )

    def _aborted_error(self) -> ApiError:
        if self.ctx.admission.state is ServerState.DRAINING:
            return ApiError(
                503, "the server shut down before this request started", code="draining"
            )
        timeout = self.ctx.config.request_timeout
        return ApiError(
            503,
            f"the request did not start within the request timeout of {timeout} s",
            code="request_timeout",
            headers={"Retry-After": "1"},
        )

    def fail(self, error: ApiError) -> None:
        self.status, self.error = error.status, error.code or "error"

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _ttft(self) -> float | None:
        return None if self.first_output is None else self.first_output - self.arrival

    def _tpot(self) -> float | None:
        tokens = max((len(c.token_ids) for c in self.choices), default=0)
        if self.first_output is None or self.last_output is None or tokens < 2:
            return None
        return (self.last_output - self.first_output) / (tokens - 1)

    def _account(self) -> None:
        reasons = [c.finish_reason or "abort" for c in self.choices]
        self.ctx.metrics.finished(
            self.completion_tokens,
            reasons,
            ttft=self._ttft(),
            e2e=time.monotonic() - self.arrival,
            queue_time=self.queue_time,
            tpot=self._tpot(),
        )

    def _log(self) -> None:
        reasons = sorted({c.finish_reason for c in self.choices if c.finish_reason})
        log_request(
            RequestRecord(
                request_id=self.request_id,
                endpoint=self.endpoint,
                status=self.status,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                cached_tokens=self.cached_tokens,
                queue_time=self.queue_time,
                ttft=self._ttft(),
                tpot=self._tpot(),
                e2e=time.monotonic() - self.arrival,
                finish_reason=",".join(reasons) or None,
                error=self.error,
                stages=stage_times(self.http.scope.get("state", {})) if debug_stages() else None,
                arrival=self.arrival if debug_stages() else None,
                step_budget=self.step_budget if debug_stages() else None,
                **self._cost(),
            )
        )

    def _note_step_budget(self, budget: int | None) -> None:
        if budget is not None:
            self.step_budget = budget if self.step_budget is None else min(self.step_budget, budget)

    def _cost(self) -> dict[str, float]:
        if not self._admitted:
            return {}
        cost: dict[str, float] = {"engine_s": self.engine_seconds}
        per_hour = self.ctx.config.cost_per_hour
        if per_hour is not None:
            cost["cost_usd"] = self.engine_seconds * per_hour / 3600
        return cost


async def _disconnected(http: Request) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
