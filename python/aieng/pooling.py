"""How a request's hidden states become one embedding: `PoolingParams`, and where they come from.

A checkpoint saved by sentence-transformers says how it pools: `modules.json` lists its modules
(`sentence_transformers.models.Pooling` with its folder, `...Normalize`), and the pooling
folder's `config.json` sets one `pooling_mode_*` flag (CLS, mean or last token). Without those
files the engine's default (`EngineArgs.pooling`, `aieng serve --pooling`) or the request's
method (`pooling="mean"`) is used, and the embedding is then L2-normalised.
The runner pools (`aieng.worker.embedding_pooler`); this module only says how.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np

from aieng.errors import InvalidArgumentError

PoolingMethod = Literal["cls", "mean", "last"]
POOLING_METHODS: tuple[str, ...] = get_args(PoolingMethod)
# sentence-transformers' Pooling config: one `pooling_mode` (v5+), or one flag set (older)
_ST_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
_ST_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
# Module classes by name (the package path moved between sentence-transformers versions).
_ST_FOLLOWED = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: how its prompt's final hidden states are pooled (`method` over the
    prompt's positions: the first, their mean, or the last) and whether the result is scaled to
    unit length."""

    method: PoolingMethod
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise InvalidArgumentError(
                f"pooling must be one of {', '.join(POOLING_METHODS)}, got {self.method!r}"
            )


def sentence_transformers_pooling(folder: str | Path) -> PoolingParams | None:
    """The pooling a sentence-transformers checkpoint declares, or None when it has no
    `modules.json` or no Pooling module. A declaration aieng cannot follow (several modes, a
    mode it lacks) raises ValueError naming the file."""
    root = Path(folder)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file}: expected a list of modules")
    kinds = {
        str(m.get("type", "")).rsplit(".", 1)[-1]: str(m.get("path", ""))
        for m in modules
        if isinstance(m, dict)
    }
    if "Pooling" not in kinds:
        return None
    unknown = sorted(set(kinds) - set(_ST_FOLLOWED))
    if unknown:
        raise ValueError(
            f"{modules_file}: aieng runs only {', '.join(_ST_FOLLOWED)} modules, not "
            f"{', '.join(unknown)}"
        )
    config_file = root / kinds["Pooling"] / "config.json"
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: expected an object")
    if "pooling_mode" in config:
        chosen = [_ST_MODES.get(str(config["pooling_mode"]), str(config["pooling_mode"]))]
    else:
        chosen = [method for flag, method in _ST_FLAGS.items() if config.get(flag)]
        chosen += [
            k
            for k, v in config.items()
            if k.startswith("pooling_mode_") and k not in _ST_FLAGS and v
        ]
        chosen = list(dict.fromkeys(chosen))
    if len(chosen) != 1 or chosen[0] not in POOLING_METHODS:
        raise ValueError(
            f"{config_file}: aieng pools with exactly one of cls, mean, last token; this "
            f"checkpoint asks for {', '.join(chosen) or 'none'}"
        )
    return PoolingParams(chosen[0], normalize="Normalize" in kinds)  # type: ignore[arg-type]


def resolve_pooling(
    requested: PoolingParams | str | None, declared: PoolingParams | None
) -> PoolingParams:
    """The pooling of one embedding request: the one asked for (a PoolingParams, or a method
    name: normalised), else the engine's default (`declared`: the checkpoint's, or
    EngineArgs.pooling's). InvalidArgumentError when neither says."""
    if isinstance(requested, PoolingParams):
        return requested
    if isinstance(requested, str):
        return PoolingParams(requested)  # type: ignore[arg-type]
    if requested is not None:
        raise InvalidArgumentError(
            f"pooling must be a method name or PoolingParams, got {type(requested).__name__}"
        )
    if declared is None:
        raise InvalidArgumentError(
            "pooling: this model declares no pooling (no sentence-transformers modules.json) "
            f"and the engine sets no default (--pooling); ask for one of "
            f"{', '.join(POOLING_METHODS)}"
        )
    return declared


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read: {e}") from e


def check_dimensions(dimensions: int | None, size: int) -> None:
    """`dimensions` (Matryoshka truncation) must be 1..size, the model's embedding size."""
    if dimensions is None:
        return
    if (
        not isinstance(dimensions, int)
        or isinstance(dimensions, bool)
        or not (1 <= dimensions <= size)
    ):
        raise InvalidArgumentError(
            f"dimensions must be an integer from 1 to the model's embedding size {size}, "
            f"got {dimensions!r}"
        )


def truncate_dimensions(vector: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first `dimensions` components, scaled back to unit length (Matryoshka embeddings);
    the vector itself when dimensions is None."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = np.asarray(vector[:dimensions], np.float32)
    norm = float(np.linalg.norm(head))
    return head / norm if norm > 0 else head
