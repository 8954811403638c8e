"""The default model: a small Llama trained from scratch on the King James Bible, shipped inside
the package (see MODEL_CARD.md). `LLM()`, `aieng generate` and `aieng serve` use it when no model
is named."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "aieng-kjv-6m"
_FOLDER = Path(__file__).resolve().parent.parent / "default_model"


def default_model_path() -> Path:
    """The bundled checkpoint folder; FileNotFoundError if this install lacks it."""
    if not (_FOLDER / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled default model is missing from {_FOLDER}; reinstall aieng or pass a "
            "model folder"
        )
    return _FOLDER


def resolve_model(model: str | Path | None) -> Path:
    """A model folder path, or the default model's when `model` is None."""
    return default_model_path() if model is None else Path(model)


def served_name(model: str | Path | None) -> str:
    """The name a model is served under by default: the bundled model's own name when `model`
    is None, else its folder's name."""
    if model is None:
        return DEFAULT_MODEL_NAME
    return Path(model).name or str(model)
