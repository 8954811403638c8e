"""Embeddings through aieng: an `LLM` in this process (`LLM.embed`, one call at a time), or an
aieng server's `POST /v1/embeddings`."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np

from aieng import LLM
from aieng.config.default_model import default_model_path
from aieng.core import Tokenizer


class AiengEmbedder:
    """Unit-length embeddings of texts from an aieng model (default: the bundled KJV model,
    mean-pooled), pooled as its checkpoint says, else by `pooling` (the engine's default)."""

    def __init__(self, model: str | Path | None = None, pooling: str | None = None, **engine):
        self.llm = LLM(None if model is None else str(model), pooling=pooling, **engine)
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
            outputs = self.llm.embed(ids)
        return np.stack([o.embedding for o in outputs]).astype(np.float32)

    def close(self) -> None:
        self.llm.shutdown()


class ServerEmbedder:
    """The same embeddings from an aieng server's `POST /v1/embeddings` (the generation server
    itself, so the service loads no second model), asked as any OpenAI client asks (no
    `pooling`: the model's own, or the server's `--pooling`); tokens counted with the model's
    tokenizer."""

    def __init__(
        self,
        base_url: str,
        model: str,
        model_folder: str | Path | None = None,
        timeout_s: float = 60.0,
    ):
        folder = default_model_path() if model_folder is None else Path(model_folder)
        self.tokenizer = Tokenizer.from_dir(str(folder))
        self.base_url, self.model = base_url.rstrip("/"), model
        self.http = httpx.Client(timeout=timeout_s)
        info = self.http.get(f"{self.base_url}/models/{model}").json()
        self.max_tokens = int(info["max_model_len"]) - 1
        self.dimensions = len(self.embed(["dimensions"])[0])

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=True))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        ids = [self.tokenizer.encode(t, add_special_tokens=True)[: self.max_tokens] for t in texts]
        body = {"model": self.model, "input": [i or [0] for i in ids]}
        response = self.http.post(f"{self.base_url}/embeddings", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"embeddings: {response.status_code} {response.text[:300]}")
        data = sorted(response.json()["data"], key=lambda d: d["index"])
        return np.array([d["embedding"] for d in data], np.float32)

    def close(self) -> None:
        self.http.close()
