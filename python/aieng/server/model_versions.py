"""Versions of the served model and the switch between them: hot reload with double buffering.

`aieng serve --model-dir DIR` serves one model name from a folder of versions — each a
subfolder holding a checkpoint and its `aieng-model.json` — starting with the latest stable
version. An admin loads another version while the current one keeps serving:

1. refused at once (507) if its `requirements.memory_bytes` exceed the memory free now, or if
   its device requirement does not match; one load at a time (409);
2. loaded in a worker thread into a second engine (the first keeps serving), started, and
   given a smoke generation (greedy, a few tokens) that must finish normally;
3. switched in: one assignment on the event loop, so every request admitted from then on goes
   to the new engine, and every request already admitted finishes on the old one (a request
   holds the engine it was admitted to for its whole life);
4. the old engine drains: once it holds no request it is stopped and every reference dropped,
   and the memory figure before and after is recorded (`GET /admin/models`).

A failed load leaves the serving version untouched, with the failure in the version's state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from aieng.config.model_manifest import MANIFEST, ManifestError, ModelManifest, Version
from aieng.sampling import SamplingParams
from aieng.server.traffic_split import TrafficSplit

if TYPE_CHECKING:
    from aieng.engine.engine_client import EngineClient
    from aieng.engine.llm_engine import LLMEngine
    from aieng.server.context import ServerContext

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def differing_tokenizer_file(old: Path, new: Path) -> str | None:
    """The first of the tokenizer files that two model folders do not share byte for byte (one
    has it and the other not, or their bytes differ); None when they tokenize alike."""
    for name in TOKENIZER_FILES:
        old_file, new_file = old / name, new / name
        same = old_file.is_file() == new_file.is_file() and (
            not old_file.is_file() or old_file.read_bytes() == new_file.read_bytes()
        )
        if not same:
            return name
    return None


SMOKE_PROMPT_TOKENS = 4
SMOKE_MAX_TOKENS = 4
DRAIN_POLL_S = 0.05


class VersionError(ValueError):
    """A load or unload that cannot be done; `status` is the HTTP answer."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code


def scan_model_dir(folder: Path) -> dict[str, dict[str, ModelManifest]]:
    """DIR/* with an aieng-model.json -> {name: {version: manifest}}."""
    if not folder.is_dir():
        raise ValueError(f"--model-dir {folder}: not a folder")
    subfolders = sorted(folder.resolve().iterdir())
    found = [ModelManifest.load(sub) for sub in subfolders if (sub / MANIFEST).is_file()]
    if not found:
        raise ValueError(f"--model-dir {folder}: no subfolder holds {MANIFEST}")
    catalog: dict[str, dict[str, ModelManifest]] = {}
    for manifest in found:
        versions = catalog.setdefault(manifest.name, {})
        key = str(manifest.version)
        if key in versions:
            raise ValueError(
                f"--model-dir {folder}: {manifest.name} {key} is in both {versions[key].folder} "
                f"and {manifest.folder}"
            )
        versions[key] = manifest
    return catalog


def default_version(versions: dict[str, ModelManifest]) -> ModelManifest:
    """The latest stable version, or the newest pre-release where there is none."""
    stable = [m for m in versions.values() if m.version.stable]
    return max(stable or list(versions.values()), key=lambda m: m.version.sort_key())


def latest_stable(versions: dict[str, ModelManifest]) -> ModelManifest:
    stable = [m for m in versions.values() if m.version.stable]
    if not stable:
        raise ValueError(
            f"no stable version of {next(iter(versions.values())).name} (all are pre-releases: "
            f"{', '.join(sorted(versions))})"
        )
    return max(stable, key=lambda m: m.version.sort_key())


def serving_version(
    model_path: str | None, catalog: dict[str, dict[str, ModelManifest]]
) -> ModelManifest:
    """The version the server's own engine starts with: the one at `model_path` if it is in
    the catalog, else the latest stable of the first name."""
    given = Path(model_path).resolve() if model_path else None
    for versions in catalog.values():
        for manifest in versions.values():
            if manifest.folder is not None and manifest.folder == given:
                return manifest
    return latest_stable(catalog[sorted(catalog)[0]])


def free_memory_bytes(device: str) -> int:
    """Memory a new version could use now: the GPU's free memory, else available RAM."""
    if device == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info()
        return int(free)
    from aieng.worker.host_memory import available_ram

    return available_ram()


def process_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@dataclass
class VersionState:
    manifest: ModelManifest
    # available | loading | serving | canary | shadow | draining | unloaded | failed
    state: str = "available"
    error: str | None = None
    load_s: float | None = None
    rss_before_unload: int | None = None
    rss_after_unload: int | None = None
    history: list[tuple[float, str]] = field(default_factory=list)

    def set(self, state: str, error: str | None = None) -> None:
        self.state, self.error = state, error
        self.history.append((time.time(), state))

    def describe(self) -> dict[str, Any]:
        requirements = self.manifest.requirements
        body: dict[str, Any] = {
            "name": self.manifest.name,
            "version": str(self.manifest.version),
            "stable": self.manifest.version.stable,
            "state": self.state,
            "requirements": {
                "memory_bytes": requirements.memory_bytes,
                "device": requirements.device,
            },
        }
        for key in ("error", "load_s", "rss_before_unload", "rss_after_unload"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        return body


class ModelVersions:
    """The versions one server knows, which one serves, and the switch between them."""

    def __init__(
        self,
        versions: dict[str, ModelManifest],
        serving: str,
        load_version: Callable[[Path], LLMEngine],
        primary: bool = True,
    ):
        """`primary`: the server's own engine (ctx.engine) serves the default version; another
        model of the catalog keeps its default engine here (loaded by `start_default`)."""
        self.states = {key: VersionState(m) for key, m in versions.items()}
        self.states[serving].set("serving" if primary else "loading")
        self.serving = serving
        self.primary = primary
        self._engine: EngineClient | None = None  # the default engine when not primary
        self.name = versions[serving].name
        self._load_version = load_version
        self._loading: asyncio.Task | None = None
        self._draining: dict[str, EngineClient] = {}
        self.split: TrafficSplit | None = None  # a canary or shadow candidate
        # `--serve-all-versions`: other versions loaded beside the default one, each served to
        # requests for name@version (state "loaded")
        self.pinned: dict[str, EngineClient] = {}
        self.background: asyncio.Task | None = None  # load_all, when asked for

    def stop_all(self) -> None:
        """Server shutdown: every engine but the default one (the server stops that)."""
        if self.background is not None:
            self.background.cancel()
        engines = [*self.pinned.values(), *self._draining.values()]
        if self.split is not None:
            engines.append(self.split.engine)
        if self._engine is not None:
            engines.append(self._engine)
        for engine in engines:
            engine.shutdown()

    def default_engine(self, ctx: ServerContext) -> EngineClient | None:
        return ctx.engine if self.primary else self._engine

    def _set_default(self, ctx: ServerContext, engine: EngineClient) -> None:
        if self.primary:
            ctx.switch_engine(engine)
        else:
            self._engine = engine

    async def start_default(self, ctx: ServerContext) -> None:
        """A model other than the server's own: its default version loads in the background
        (requests for it get 503 until it serves)."""
        state = self.states[self.serving]
        try:
            self._engine = await self._load(ctx, state)
        except Exception as error:
            logger.exception("loading %s failed", state.manifest.ref)
            state.set("failed", f"{type(error).__name__}: {error}")
            return
        state.set("serving")
        logger.info("serving %s", state.manifest.ref)

    def engine_for(self, ctx: ServerContext, version: str) -> EngineClient | None:
        """The engine serving `version` (None: not loaded)."""
        if version == self.serving:
            return self.default_engine(ctx)
        if self.split is not None and version == self.split.version:
            return self.split.engine
        return self.pinned.get(version)

    async def load_all(self, ctx: ServerContext) -> None:
        """At start (`--serve-all-versions`): every other version that fits in the memory free
        now is loaded beside the default one, newest first; the others stay available."""
        ordered = sorted(self.states.values(), key=lambda s: s.manifest.version.sort_key())
        for state in reversed(ordered):
            version = str(state.manifest.version)
            if version == self.serving:
                continue
            try:
                self._check_fits(ctx, state)
                state.set("loading")
                engine = await self._load(ctx, state)
            except Exception as error:
                state.set("available", f"not loaded at start: {error}")
                logger.warning("%s@%s not loaded at start: %s", self.name, version, error)
                continue
            self.pinned[version] = engine
            state.set("loaded")
            logger.info("%s@%s loaded beside %s", self.name, version, self.serving)

    def resolve(self, model: str) -> str | None:
        """`name` or `name@version` -> the version to serve it with (None: not this model)."""
        name, _, version = model.partition("@")
        if name != self.name:
            return None
        return version or self.serving

    def describe(self) -> list[dict[str, Any]]:
        ordered = sorted(self.states.values(), key=lambda s: s.manifest.version.sort_key())
        return [s.describe() for s in ordered]

    def start_load(
        self, ctx: ServerContext, version: str, split: tuple[str, float] | None = None
    ) -> VersionState:
        """Checks what can be checked at once, then loads in the background; then switches to
        it, or with `split` = (mode, percent) serves it beside the primary (traffic_split)."""
        state = self.states.get(version)
        if state is None:
            raise VersionError(
                404,
                f"{self.name} has no version {version!r} (known: {', '.join(sorted(self.states))})",
                "version_not_found",
            )
        if version == self.serving or (self.split is not None and version == self.split.version):
            raise VersionError(409, f"{self.name}@{version} is already serving", "already_serving")
        if split is not None and self.split is not None:
            raise VersionError(
                409,
                f"{self.name}@{self.split.version} already takes {self.split.mode} traffic; "
                "end that route first",
                "route_in_use",
            )
        if self._loading is not None and not self._loading.done():
            raise VersionError(409, "another version is loading; wait for it", "load_in_progress")
        if state.state == "draining":
            raise VersionError(409, f"{self.name}@{version} is still draining", "draining")
        if version in self.pinned and split is None:  # already loaded: switch at once
            self._promote(ctx, version)
            return state
        if version in self.pinned:
            raise VersionError(409, f"{self.name}@{version} is loaded and served", "loaded")
        self._check_folder(state.manifest)
        self._check_fits(ctx, state)
        self._check_tokenizer(state.manifest)
        state.set("loading")
        self._loading = asyncio.create_task(self._load_and_switch(ctx, version, split))
        return state

    def _check_fits(self, ctx: ServerContext, state: VersionState) -> None:
        version, requirements = str(state.manifest.version), state.manifest.requirements
        device = ctx.engine.model_info.device.split(":")[0] if ctx.engine is not None else "cpu"
        if requirements.device not in ("any", device):
            raise VersionError(
                507,
                f"{self.name}@{version} requires device {requirements.device!r}; this server "
                f"runs on {device!r}",
                "device_mismatch",
            )
        free = free_memory_bytes(device)
        if requirements.memory_bytes > free:
            raise VersionError(
                507,
                f"{self.name}@{version} requires {requirements.memory_bytes} bytes of memory; "
                f"{free} are free while the loaded versions hold their own",
                "insufficient_memory",
            )

    def _promote(self, ctx: ServerContext, version: str) -> None:
        """A loaded version becomes the default; the old default stays loaded for name@version."""
        engine = self.pinned.pop(version)
        old_version, old_engine = self.serving, self.default_engine(ctx)
        self._set_default(ctx, engine)
        self.serving = version
        self.states[version].set("serving")
        if old_engine is not None:
            self.pinned[old_version] = old_engine
            self.states[old_version].set("loaded")
        logger.info("%s@%s is the default version now", self.name, version)

    def _check_folder(self, manifest: ModelManifest) -> None:
        """A version found at start whose folder (or its manifest) has since been removed."""
        folder = manifest.folder
        assert folder is not None
        if not (folder / MANIFEST).is_file():
            gone = f"its folder {folder}" if not folder.is_dir() else f"its {folder / MANIFEST}"
            raise VersionError(
                404,
                f"{manifest.ref}: {gone} is gone (removed since the server scanned "
                "--model-dir); restore it to load this version",
                "version_folder_missing",
            )

    def _check_tokenizer(self, manifest: ModelManifest) -> None:
        """A switch keeps requests tokenized by one version running on the other (those admitted
        around the switch), so versions must share their tokenizer."""
        serving = self.states[self.serving].manifest.folder
        assert serving is not None and manifest.folder is not None
        if not serving.is_dir():
            raise VersionError(
                409,
                f"{self.name}@{self.serving}: the serving version's folder {serving} is gone, so "
                f"{manifest.ref}'s tokenizer cannot be compared with its own; restore it",
                "version_folder_missing",
            )
        name = differing_tokenizer_file(serving, manifest.folder)
        if name is not None:
            raise VersionError(
                409,
                f"{manifest.ref}: its {name} differs from the serving version's; a hot "
                "switch needs one tokenizer (restart the server to change it)",
                "tokenizer_mismatch",
            )

    async def _load_and_switch(
        self, ctx: ServerContext, version: str, split: tuple[str, float] | None = None
    ) -> None:
        state = self.states[version]
        try:
            new = await self._load(ctx, state)
        except Exception as error:  # the serving version stays
            logger.exception("loading %s@%s failed", self.name, version)
            state.set("failed", f"{type(error).__name__}: {error}")
            return
        if split is not None:
            mode, percent = split
            self.split = TrafficSplit(version, new, mode, percent)
            state.set(mode)
            logger.info("%s@%s takes %s traffic", self.name, version, mode)
            return
        old_version, old_engine = self.serving, self.default_engine(ctx)
        self._set_default(ctx, new)  # atomic: the next admitted request goes to the new version
        self.serving = version
        state.set("serving")
        logger.info("%s@%s serving (loaded in %.2f s)", self.name, version, state.load_s)
        if old_engine is not None:
            self.states[old_version].set("draining")
            self._draining[old_version] = old_engine
            del old_engine, new  # only _draining holds the old engine now: freeing it frees it
            await self._drain(ctx, old_version)

    async def _load(self, ctx: ServerContext, state: VersionState) -> EngineClient:
        """Loads a version into a new engine (in a worker thread), starts it and smoke-tests it;
        stopped again if the smoke generation fails."""
        from aieng.engine.async_engine import AsyncLLMEngine

        start = time.perf_counter()
        folder = state.manifest.folder
        assert folder is not None
        engine = await asyncio.to_thread(self._load_version, folder)
        new = AsyncLLMEngine(engine, on_step=ctx.metrics.observe_step)
        new.start()
        try:
            await self._smoke(new, str(state.manifest.version))
        except BaseException:
            new.shutdown()
            raise
        state.load_s = round(time.perf_counter() - start, 3)
        return new

    async def _smoke(self, engine: EngineClient, version: str) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=SMOKE_MAX_TOKENS, ignore_eos=True)
        prompt = list(range(1, SMOKE_PROMPT_TOKENS + 1))
        last = None
        async for out in engine.generate(f"smoke-{version}-{time.monotonic_ns()}", prompt, params):
            last = out
        if last is None or not last.finished or last.outputs[0].finish_reason != "length":
            reason = None if last is None else last.outputs[0].finish_reason
            raise RuntimeError(f"the smoke generation ended with {reason!r}, not 'length'")

    async def _drain(self, ctx: ServerContext, version: str) -> None:
        """Waits for the old engine's in-flight requests, then frees it."""
        engine = self._draining.get(version)
        if engine is None:
            return
        key = id(engine)
        while engine.alive and (engine.stats.num_requests > 0 or ctx.leases.get(key, 0) > 0):
            await asyncio.sleep(DRAIN_POLL_S)
        del engine
        await self._free(version)

    async def end_split(self, ctx: ServerContext) -> VersionState:
        """Stops sending traffic to the candidate; it drains and is freed."""
        split = self.split
        if split is None:
            raise VersionError(404, f"{self.name} has no canary or shadow route", "no_route")
        self.split = None
        state = self.states[split.version]
        state.set("draining")
        self._draining[split.version] = split.engine
        for task in list(split.tasks):
            task.cancel()
        version = split.version
        del split
        await self._drain(ctx, version)
        return state

    async def unload(self, ctx: ServerContext, version: str) -> VersionState:
        """DELETE: a draining version is aborted and freed now; the serving one cannot go."""
        state = self.states.get(version)
        if state is None:
            raise VersionError(404, f"{self.name} has no version {version!r}", "version_not_found")
        if version == self.serving:
            raise VersionError(
                409,
                f"{self.name}@{version} is serving; load another version first",
                "serving",
            )
        if version in self.pinned:  # stop serving name@version; drain, then free
            self._draining[version] = self.pinned.pop(version)
            state.set("draining")
            await self._drain(ctx, version)
        elif version in self._draining:
            self._draining[version].abort_all()
            await self._free(version)
        elif state.state == "loading" and self._loading is not None:
            self._loading.cancel()
            state.set("unloaded")
        return state

    async def _free(self, version: str) -> None:
        engine = self._draining.pop(version, None)
        if engine is None:
            return
        state = self.states[version]
        state.rss_before_unload = process_rss_bytes()
        await asyncio.to_thread(engine.shutdown)
        del engine
        await asyncio.to_thread(_return_cached_gpu_memory)
        state.rss_after_unload = process_rss_bytes()
        state.set("unloaded")
        logger.info(
            "%s@%s unloaded (RSS %d -> %d bytes)",
            self.name,
            version,
            state.rss_before_unload,
            state.rss_after_unload,
        )


def _return_cached_gpu_memory() -> None:
    """The engine's shutdown freed its tensors; torch's allocator keeps their memory cached
    until this returns it to the device."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


__all__ = [
    "ManifestError",
    "ModelVersions",
    "Version",
    "VersionError",
    "latest_stable",
    "scan_model_dir",
]
