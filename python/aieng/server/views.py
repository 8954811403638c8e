"""What the server's modules see of each other, as Protocols, so that the hub (`context`) and
the traffic split never import the modules that use them (`generation`, `model_versions`):
the server's imports stay a tree."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from aieng.engine.engine_client import EngineClient, EngineStats
from aieng.sampling import SamplingParams

if TYPE_CHECKING:
    from aieng.server.metrics import ServerMetrics


class ChoiceView(Protocol):
    text: list[str]
    token_ids: list[int]
    finish_reason: str | None


class AdmittedGeneration(Protocol):
    """A generation request once admitted (`aieng.server.generation.Generation`)."""

    engine: EngineClient
    http: Any  # the starlette Request
    request_id: str
    engine_ids: list[str]
    prompts: Sequence[Sequence[int]]
    params: Sequence[SamplingParams]
    n: int
    choices: Sequence[ChoiceView]
    done: asyncio.Event
    arrival: float
    last_output: float | None


class ShadowHost(Protocol):
    """What mirroring reads of the server (`aieng.server.context.ServerContext`)."""

    metrics: ServerMetrics

    def stats(self) -> EngineStats | None: ...


class SplitView(Protocol):
    """A canary or shadow candidate (`aieng.server.traffic_split.TrafficSplit`)."""

    version: str
    engine: EngineClient
    mode: str

    def takes_request(self) -> bool: ...


class ModelVersionsView(Protocol):
    """One model's versions (`aieng.server.model_versions.ModelVersions`) as the context
    routes requests to them."""

    name: str
    serving: str
    pinned: Mapping[str, EngineClient]
    split: SplitView | None

    def default_engine(self, ctx: Any) -> EngineClient | None: ...

    def resolve(self, model: str) -> str | None: ...
