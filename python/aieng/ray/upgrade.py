"""A rolling upgrade of the replicas from one model version to another, with no failed request.

The new version is a versioned model folder (a checkpoint and its `aieng-model.json`) every
replica can read. It is gated first, as `aieng model check` and the server's hot switch gate a
version: the same model name, another version, output and input schemas its old clients can
still use (`aieng.config.schema_compat`), and the same tokenizer (the ingress tokenizes for every
replica). Then, one replica at a time:

1. the router stops sending it new requests (`ReplicaBoard.drain`): the others take them;
2. it finishes its in-flight requests, stops its engine and loads the new version
   (`EngineReplica.reload`); a request that reached it meanwhile waits and is served by the
   new version;
3. the router sends it requests again, and the next replica goes.

The ingress's admin routes (`aieng.ray.upgrade_routes`) start it and report its progress; a
failure (a version that does not load, a replica that does not drain) stops it where it is,
the failed replica back on the old version.

A replica Ray restarts later (its actor died) comes back with the deployment's arguments,
the old version: once every replica runs the new one, redeploy the application with the new
`model` (`serve deploy`, or the RayService manifest) so that restarts load it too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray.serve.handle import DeploymentHandle

from aieng.config.model_manifest import MANIFEST, ManifestError, ModelManifest
from aieng.config.schema_compat import input_problems, output_problems
from aieng.ray.board import ReplicaBoard
from aieng.ray.router import TARGET_KEY
from aieng.server.model_versions import VersionError, differing_tokenizer_file

logger = logging.getLogger(__name__)


def check_upgrade(serving: Path, new: Path) -> tuple[ModelManifest, ModelManifest]:
    """(old manifest, new manifest) when `new` may replace the version in `serving`; else a
    VersionError naming why (404 no such folder or manifest, 409 not a replacement)."""
    if not (new / MANIFEST).is_file():
        raise VersionError(
            404, f"{new}: no {MANIFEST} (not a versioned model folder)", "no_manifest"
        )
    if not (serving / MANIFEST).is_file():
        raise VersionError(
            409,
            f"the replicas serve {serving}, which has no {MANIFEST}: a rolling upgrade moves "
            "between versioned model folders",
            "not_versioned",
        )
    try:
        old_manifest, new_manifest = ModelManifest.load(serving), ModelManifest.load(new)
    except ManifestError as error:
        raise VersionError(409, str(error), "bad_manifest") from None
    if new_manifest.name != old_manifest.name:
        raise VersionError(
            409,
            f"{new_manifest.ref} is another model than the served {old_manifest.ref}",
            "name_mismatch",
        )
    if new_manifest.version == old_manifest.version:
        raise VersionError(409, f"{old_manifest.ref} is already serving", "already_serving")
    problems = [
        *(
            f"output {p}"
            for p in output_problems(old_manifest.output_schema, new_manifest.output_schema)
        ),
        *(
            f"input {p}"
            for p in input_problems(old_manifest.input_schema, new_manifest.input_schema)
        ),
    ]
    if problems:
        raise VersionError(
            409,
            f"{old_manifest.ref} -> {new_manifest.ref} breaks its clients: {'; '.join(problems)}",
            "incompatible_schema",
        )
    name = differing_tokenizer_file(serving, new)
    if name is not None:
        raise VersionError(
            409,
            f"{new_manifest.ref}: its {name} differs from the serving version's; the ingress "
            "tokenizes for every replica, so a rolling upgrade needs one tokenizer",
            "tokenizer_mismatch",
        )
    return old_manifest, new_manifest


@dataclass
class UpgradeState:
    """The last rolling upgrade, as `GET /admin/upgrade` shows it."""

    state: str = "idle"  # idle | running | done | failed
    model: str | None = None  # the folder being rolled out
    from_version: str | None = None
    to_version: str | None = None
    replicas_done: list[str] = field(default_factory=list)
    replica: str | None = None  # the one draining or reloading now
    error: str | None = None
    started: float | None = None
    seconds: float | None = None

    def describe(self) -> dict[str, Any]:
        return dict(self.__dict__)


class RollingUpgrade:
    """One rolling upgrade at a time over the replicas of one deployment."""

    def __init__(
        self,
        replicas: DeploymentHandle,
        board: ReplicaBoard,
        drain_timeout_s: float,
        on_done: Callable[[], Awaitable[None]] | None = None,
    ):
        """`on_done`: awaited once every replica serves the new version (the ingress reads
        the new version's model info)."""
        self.replicas, self.board, self.drain_timeout_s = replicas, board, drain_timeout_s
        self.on_done = on_done
        self.status = UpgradeState()
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self, serving: Path, new: Path) -> UpgradeState:
        """Gates `new` against `serving`, then upgrades in the background (a VersionError when
        it may not start)."""
        if self.running:
            raise VersionError(409, "a rolling upgrade is already running", "upgrade_in_progress")
        old_manifest, new_manifest = check_upgrade(serving, new)
        self.status = UpgradeState(
            state="running",
            model=str(new),
            from_version=str(old_manifest.version),
            to_version=str(new_manifest.version),
            started=time.time(),
        )
        self._task = asyncio.create_task(self._run(new, self.status))
        return self.status

    async def _run(self, new: Path, status: UpgradeState) -> None:
        start = time.monotonic()
        try:
            while True:  # a replica that started meanwhile (autoscaling, a restart) goes too
                left = sorted(
                    replica
                    for replica, report in self.board.reports().items()
                    if report.version != status.to_version and replica not in status.replicas_done
                )
                if not left:
                    break
                replica = left[0]
                status.replica = replica
                self.board.drain(replica)
                try:
                    call = self.replicas.options(method_name="reload")
                    await call.remote(
                        model=str(new),
                        drain_timeout_s=self.drain_timeout_s,
                        **{TARGET_KEY: replica},
                    )
                finally:
                    self.board.undrain(replica)
                status.replicas_done.append(replica)
                logger.info("rolling upgrade: replica %s serves %s", replica, status.to_version)
            if self.on_done is not None:
                await self.on_done()
            status.state = "done"
        except Exception as error:
            status.state, status.error = "failed", f"{type(error).__name__}: {error}"
            logger.error("rolling upgrade to %s failed: %s", new, status.error)
        finally:
            status.replica = None
            status.seconds = round(time.monotonic() - start, 3)
