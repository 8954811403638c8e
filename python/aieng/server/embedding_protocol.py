"""The body of `POST /v1/embeddings` (OpenAI's shape), validated as strictly as the others."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from aieng.pooling import PoolingMethod
from aieng.server.protocol import Prompt, Str, _Strict, check_prompt_shape, prompt_list

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one request


class EmbeddingRequest(_Strict):
    model: Str | None = None
    # a string, a list of strings, token ids or a list of token-id lists
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # checked against the model's size by the route
    user: Str | None = None
    # aieng's: how to pool when the checkpoint declares nothing (no sentence-transformers files)
    pooling: PoolingMethod | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: object) -> object:
        checked = check_prompt_shape(value)
        if len(prompt_list(checked)) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
        return checked

    @property
    def inputs(self) -> list[str] | list[list[int]]:
        return prompt_list(self.input)
