"""What every route shares: the config, the engine (once loaded), admission and metrics."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Request

from aieng.engine.engine_client import EngineClient, EngineStats
from aieng.server.admission import Admission, ServerState
from aieng.server.config import ServerConfig
from aieng.server.errors import ApiError, invalid
from aieng.server.fair_pool import FairPool
from aieng.server.metrics import ServerMetrics
from aieng.server.request_log import RequestRecord, log_request
from aieng.server.small_first import SmallFirst
from aieng.server.tokenizing import TokenizerPool
from aieng.server.traffic_split import mirror
from aieng.worker.gpu_memory import GpuMemory

if TYPE_CHECKING:
    from aieng.server.views import AdmittedGeneration, ModelVersionsView


class ServerContext:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.engine: EngineClient | None = None
        self.model_defaults: dict[str, Any] = {}
        self.created = int(time.time())
        self.admission = Admission(config, self.stats)
        self.tokenizing = TokenizerPool()
        self.parsing = FairPool(1, "aieng-parse")  # large bodies: see offloop
        # large bodies' reads and parses wait while small requests await their first answer
        hold_s = config.small_first_ms / 1000
        self.small_first: SmallFirst | None = SmallFirst(hold_s) if hold_s else None
        self.metrics = ServerMetrics(
            config.served_model_name,
            self.stats,
            self.gpu_memory,
            engine_dead=lambda: self.engine_failed,
            cost_per_hour=config.cost_per_hour,
            load_phases=self.load_phases,
            admission_waiting=lambda: self.admission.num_at_gates,
        )
        self._ids = itertools.count()
        self._token_text: dict[int, str] = {}
        self.warned_fields: set[str] = set()  # unknown request fields already logged
        # `--model-dir`: the versions of the served model (None: one model, no versions)
        self.versions: ModelVersionsView | None = None  # the server's own model's
        self.catalog: dict[str, ModelVersionsView] = {}  # every model of --model-dir, by name
        self.catalog_loading: asyncio.Task | None = None
        # generation requests admitted to each engine (by id) and not yet answered in full:
        # an engine switched out is freed only once its count is 0
        self.leases: Counter[int] = Counter()

    def stats(self) -> EngineStats | None:
        return None if self.engine is None else self.engine.stats

    def load_phases(self) -> dict[str, float] | None:
        return None if self.engine is None else dict(self.engine.model_info.load_phases)

    def gpu_memory(self) -> GpuMemory | None:
        return None if self.engine is None else self.engine.gpu_memory()

    def attach(self, engine: EngineClient) -> None:
        self.engine = engine
        self.model_defaults = dict(engine.model_info.generation_defaults)
        self.admission.state = ServerState.READY

    def ready_engine(
        self, generation_request: Request | None = None, model: str | None = None
    ) -> EngineClient:
        """The engine, or 503 while it loads, after a failure, or while draining. A generation
        request refused here is counted and logged like any other refusal."""
        state = self.admission.state
        error = None
        if state is ServerState.DRAINING:
            error = ApiError(503, "the server is shutting down", code="draining")
        elif self.engine is None or state is ServerState.STARTING:
            error = ApiError(
                503, "the model is still loading", code="starting", headers={"Retry-After": "5"}
            )
        elif not self.engine.alive:
            error = ApiError(503, self.engine.not_running(), code="engine_dead")
        if error is None:
            assert self.engine is not None
            if generation_request is None:
                return self.engine
            engine, version = self.engine, None
            versions = self.versions_of(model)
            if versions is not None:
                default = versions.default_engine(self)
                if default is None:
                    raise ApiError(
                        503,
                        f"model {versions.name!r} is still loading",
                        code="starting",
                        headers={"Retry-After": "5"},
                    )
                engine, version = default, versions.serving
                asked = versions.resolve(model) if model else None
                pinned = None if asked is None else versions.pinned.get(asked)
                split = versions.split
                if pinned is not None:  # name@version of a version loaded beside the default
                    engine, version = pinned, asked
                elif split is not None and split.engine.alive and split.takes_request():
                    engine, version = split.engine, split.version  # canary
            state = generation_request.scope.setdefault("state", {})
            if "engine_lease" not in state:  # released by EngineLeaseMiddleware
                self.leases[id(engine)] += 1
                state["engine_lease"] = id(engine)
            if version is not None:
                state["model_version"] = version
            return engine
        if generation_request is not None:
            self.metrics.rejected(error.code or "unavailable")
            log_request(
                RequestRecord(
                    request_id=request_id_of(generation_request),
                    endpoint=generation_request.url.path,
                    status=error.status,
                    error=error.code,
                )
            )
        raise error

    @property
    def engine_failed(self) -> bool:
        """The engine loop died of a failure: the server should exit non-zero and be restarted."""
        return self.engine is not None and self.engine.failure is not None

    def versions_of(self, model: str | None) -> ModelVersionsView | None:
        """The versions of the model a request names (the server's own without a name)."""
        if model is not None and self.catalog:
            found = self.catalog.get(model.partition("@")[0])
            if found is not None:
                return found
        return self.versions

    def after_admitted(self, generation: AdmittedGeneration) -> None:
        """A generation request was admitted: mirror it to a shadow candidate if one runs."""
        for versions in self.catalog.values():
            split = versions.split
            default = versions.default_engine(self)
            if split is not None and split.mode == "shadow" and generation.engine is default:
                mirror(self, split, generation)

    def switch_engine(self, engine: EngineClient) -> None:
        """Requests admitted from now on go to `engine` (hot reload); those admitted before
        keep the engine they hold."""
        self.engine = engine
        self.model_defaults = dict(engine.model_info.generation_defaults)
        self._token_text = {}

    def release_lease(self, engine_id: int) -> None:
        self.leases[engine_id] -= 1
        if self.leases[engine_id] <= 0:
            del self.leases[engine_id]

    def check_model(self, name: str | None) -> None:
        versions = self.versions_of(name)
        if name is not None and versions is not None:
            version = versions.resolve(name)
            loaded = {versions.serving, *versions.pinned}
            if version is not None and version not in loaded:
                served = ", ".join(f"{versions.name}@{v}" for v in sorted(loaded))
                raise ApiError(
                    404,
                    f"model {name!r}: version {version} is not serving (serving: {served})",
                    param="model",
                    code="model_not_found",
                )
            if version is not None:
                return
        if name is not None and not self.config.knows_model(name):  # 404, as OpenAI answers
            served = ", ".join(
                repr(n) for n in sorted(self.catalog or {self.config.served_model_name})
            )
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )

    def new_engine_id(self) -> str:
        return f"srv-{next(self._ids)}"

    @property
    def vocab_size(self) -> int:
        assert self.engine is not None
        return self.engine.model_info.vocab_size

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"token id {bad} is outside the vocabulary [0, {vocab})", param)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            assert self.engine is not None
            text = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text


def context_of(request: Request) -> ServerContext:
    return request.app.state.context


def request_id_of(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id", "")


def arrival_of(request: Request) -> float:
    """time.monotonic() when the request reached the server (before its body was read)."""
    return request.scope.get("state", {}).get("arrival", time.monotonic())
