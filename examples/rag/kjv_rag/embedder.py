"""Embeddings through aieng: an `LLM` in this process (`LLM.embed`), one call at a time."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from aieng import LLM

DEFAULT_POOLING = "mean"  # the bundled model declares none: its mean-pooled final states


class AiengEmbedder:
    """Unit-length embeddings of texts from an aieng model (default: the bundled KJV model),
    pooled as its checkpoint says, else by `pooling`."""

    def __init__(
        self, model: str | Path | None = None, pooling: str | None = DEFAULT_POOLING, **engine
    ):
        self.llm = LLM(None if model is None else str(model), **engine)
        declared = self.llm.engine.model_info.pooling
        self.pooling = None if declared is not None else pooling
        self.max_tokens = self.llm.engine.model_info.max_model_len - 1
        self._lock = threading.Lock()  # the engine steps in one thread at a time

    @property
    def dimensions(self) -> int:
        return self.llm.engine.model_info.hidden_size

    def count_tokens(self, text: str) -> int:
        return len(self.llm.get_tokenizer().encode(text, add_special_tokens=True))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), dimensions) float32; a text past the model's context is cut to it."""
        ids = [self.llm.get_tokenizer().encode(t, add_special_tokens=True) for t in texts]
        ids = [i[: self.max_tokens] or [0] for i in ids]
        with self._lock:
            outputs = self.llm.embed(ids, pooling=self.pooling)
        return np.stack([o.embedding for o in outputs]).astype(np.float32)

    def close(self) -> None:
        self.llm.shutdown()
