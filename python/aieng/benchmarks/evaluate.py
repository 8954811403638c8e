"""Perplexity of a model on a text (`aieng eval`): a sliding window with a stride, token-weighted.

Each window of up to `window` tokens starts `stride` tokens after the one before; only the tokens
the previous window did not score are scored, each with as much left context as the window
allows (a window's first token has none, so the text's first token, and with stride == window
each window's first, go unscored — as in transformers' perplexity guide). The mean of the scored
tokens' negative log-likelihoods is exponentiated. Scores come from
`LLMEngine.prompt_logprobs`, the engine's own forward path on every rank, so this is the
yardstick for quantization and kernel changes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

from aieng._core import InvalidArgumentError
from aieng.config.engine_args import EngineArgs
from aieng.engine.llm_engine import LLMEngine


@dataclass
class PerplexityResult:
    tokens: int  # tokens scored
    text_tokens: int  # tokens in the text
    nll: float  # mean negative log-likelihood (nats per token)
    perplexity: float
    window: int
    stride: int
    seconds: float
    kernels: dict[str, str] = field(default_factory=dict)  # ModelInfo.kernels of the scorer

    def as_dict(self) -> dict:
        return asdict(self)


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored target) per window; targets are token positions in [1, n)."""
    if window < 2:
        raise InvalidArgumentError(f"window must be at least 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise InvalidArgumentError(f"stride must be in [1, window={window}], got {stride}")
    spans, scored_until, begin = [], 1, 0
    while scored_until < num_tokens:
        end = min(begin + window, num_tokens)
        # A window's first token has no context inside it: with stride == window it goes unscored.
        spans.append((begin, end, max(scored_until, begin + 1)))
        scored_until = end
        begin += stride
    return spans


class Scorer(Protocol):
    """What scores a window: an LLMEngine, or a ModelRunner of one's own (tests)."""

    def prompt_logprobs(self, token_ids: Sequence[int], chunk_size: int | None = None): ...


def perplexity_of_ids(
    scorer: Scorer, ids: Sequence[int], window: int, stride: int
) -> PerplexityResult:
    if len(ids) < 2:
        raise InvalidArgumentError(f"the text has {len(ids)} tokens; perplexity needs at least 2")
    start = time.perf_counter()
    total, count = 0.0, 0
    for begin, end, first in sliding_windows(len(ids), window, stride):
        logprobs = scorer.prompt_logprobs(ids[begin:end])  # targets begin+1 .. end-1
        scored = logprobs[first - begin - 1 :]
        total -= float(scored.double().sum())
        count += len(scored)
    nll = total / count
    return PerplexityResult(
        tokens=count,
        text_tokens=len(ids),
        nll=nll,
        perplexity=math.exp(nll),
        window=window,
        stride=stride,
        seconds=time.perf_counter() - start,
    )


def perplexity(
    model: str | Path,
    text_file: str | Path,
    *,
    window: int | None = None,
    stride: int | None = None,
    max_tokens: int | None = None,
    device: str | None = None,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    cpu_quant_kernel: str = "auto",
) -> PerplexityResult:
    """Perplexity of the checkpoint folder `model` on a UTF-8 text file. `window` defaults to the
    model's context, `stride` to half the window; `max_tokens` scores only the text's start.
    kv_cache_dtype: EngineArgs.kv_cache_dtype ('int8' scores through an INT8 cache);
    cpu_quant_kernel: EngineArgs.cpu_quant_kernel (the quantized layers' kernel on the CPU).
    Scored by an engine (`LLMEngine.prompt_logprobs`), so tensor_parallel_size > 1 scores across
    ranks."""
    path = Path(text_file)
    if not path.is_file():
        raise FileNotFoundError(f"no such text file: {path}")
    text = path.read_text(encoding="utf-8")
    # Scoring uses scratch caches sized per window; the engine's own cache stays small.
    args = EngineArgs(
        model=str(model),
        device=device or "auto",
        max_num_seqs=1,
        kv_cache_memory=16 << 20,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tensor_parallel_size,
        cpu_quant_kernel=cpu_quant_kernel,
    )
    engine = LLMEngine(args)
    try:
        ids = engine.tokenizer.encode(text, add_special_tokens=True)
        if max_tokens is not None:
            ids = ids[:max_tokens]
        context = engine.model_info.max_model_len
        window = window or context
        stride = stride or max(1, window // 2)
        if window > context:
            raise InvalidArgumentError(
                f"window {window} exceeds the model's context of {context} tokens"
            )
        result = perplexity_of_ids(engine, ids, window, stride)
        return replace(result, kernels=dict(engine.model_info.kernels))
    finally:
        engine.shutdown()
