"""`LLM`: the library entry point, with vLLM's names so existing code ports unchanged."""

from __future__ import annotations

import os
import reprlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from aieng._core import InvalidArgumentError
from aieng.config.engine_args import EngineArgs
from aieng.engine.engine_client import EngineStats
from aieng.engine.llm_engine import LLMEngine, run_as_launched_worker
from aieng.engine.offline_embed import embed_prompts
from aieng.outputs import EmbeddingRequestOutput, RequestOutput
from aieng.pooling import PoolingParams
from aieng.sampling import SamplingParams

# A prompt: text, token ids, or vLLM's dict forms {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | Sequence[int] | Mapping[str, Any]
Conversation = Sequence[Mapping[str, Any]]


class LLM:
    """An offline engine over one Hugging Face checkpoint folder (default: the bundled model).

    `generate` runs a batch to completion, `stream` yields incremental outputs of one
    prompt, `chat` renders conversations with the model's chat template first.

    Its lifetime is explicit: `shutdown()`, leaving a `with LLM(...) as llm:` block, and
    garbage collection each release every process, thread and buffer the engine started, so
    engines can be built one after another in one process. In a process a launcher (torchrun)
    started as tensor-parallel rank > 0, `LLM(...)` serves as that rank's worker until rank 0
    shuts down, then exits the process (SystemExit with the worker's status).
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs: Any):
        unknown = sorted(set(kwargs) - set(EngineArgs.field_names()))
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments: {', '.join(unknown)}")
        args = EngineArgs(model=model, **kwargs)  # no model: the bundled default model
        worker_status = run_as_launched_worker(args)
        if worker_status is not None:  # a launcher's rank > 0: it served as a worker
            raise SystemExit(worker_status)
        self.engine = LLMEngine(args)
        defaults = self.engine.model_info.generation_defaults
        self.default_sampling_params = SamplingParams(**defaults)

    __init__.__doc__ = "The engine options (`EngineArgs`), by keyword:\n\n" + EngineArgs.docstring()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_stats(self) -> EngineStats:
        """The engine's counters now: the batch, the KV cache, the prefix cache, preemptions,
        and speculative decoding's drafts, draft tokens and accepted tokens (per position)."""
        return self.engine.stats()

    def shutdown(self) -> None:
        """Releases everything the engine started (tensor-parallel workers included); the LLM
        cannot generate afterwards. Idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order."""
        batch = _as_prompt_list(prompts)
        params = self._params_for(batch, sampling_params)
        ids = self._add_all(batch, params, stream=False)
        done: dict[str, RequestOutput] = {}
        progress = _progress(len(ids), use_tqdm)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        progress(1)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            progress(None)
        return [done[rid] for rid in ids]

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yields RequestOutputs holding only what is new since the last one."""
        one = _one_prompt(prompt)
        [params] = self._params_for([one], sampling_params)
        [rid] = self._add_all([one], [params], stream=True)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort(rid)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the chat template and generates a reply."""
        if not isinstance(messages, Sequence) or not messages:
            raise InvalidArgumentError("messages must be a non-empty list")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts: list[Sequence[int]] = []
        for conversation in conversations:
            text = self.engine.tokenizer.apply_chat_template(
                list(conversation),
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            prompts.append(self.engine.tokenizer.encode(text, add_special_tokens=False))
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for out, conversation in zip(outputs, conversations, strict=True):
            out.prompt = str(conversation[-1].get("content", ""))
        return outputs

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: PoolingParams | str | None = None,
        dimensions: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order: each prompt's final hidden states pooled
        as `pooling` asks ("cls",
        "mean", "last", or PoolingParams), else as the checkpoint's sentence-transformers files
        say, else as the engine's `pooling` option; `dimensions` keeps the first components and
        renormalises. Batched through the scheduler like any prefill."""
        return embed_prompts(self.engine, _as_prompt_list(prompts), pooling, dimensions)

    # ------------------------------------------------------------------ helpers

    def _params_for(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.default_sampling_params] * len(prompts)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise InvalidArgumentError(
                f"got {len(params)} sampling params for {len(prompts)} prompts"
            )
        return params

    def _add_all(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: Sequence[SamplingParams],
        stream: bool,
    ) -> list[str]:
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                if not isinstance(p, SamplingParams):
                    raise InvalidArgumentError(f"expected SamplingParams, got {type(p).__name__}")
                rid = self.engine.new_request_id()
                self.engine.add_request(rid, prompt, p, stream=stream)
                ids.append(rid)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return ids


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | Sequence[int]]:
    if isinstance(prompts, (str, Mapping)):
        return [_one_prompt(prompts)]
    if not isinstance(prompts, Sequence):
        raise InvalidArgumentError(
            f"prompts must be a string, a list of strings or token-id lists, got "
            f"{type(prompts).__name__}"
        )
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt as token ids
    return [_one_prompt(p) for p in items]


def _one_prompt(p: Any) -> str | Sequence[int]:
    """Text or token ids; vLLM's {"prompt": text} and {"prompt_token_ids": ids} as theirs."""
    if isinstance(p, Mapping):
        keys = set(p)
        if keys == {"prompt"} and isinstance(p["prompt"], str):
            return p["prompt"]
        if keys == {"prompt_token_ids"} and isinstance(p["prompt_token_ids"], Sequence):
            return p["prompt_token_ids"]
        raise InvalidArgumentError(
            "a prompt given as a dict must be {'prompt': text} or {'prompt_token_ids': ids}, "
            f"got the keys {sorted(map(str, keys))}"
        )
    if not isinstance(p, (str, Sequence)):
        raise InvalidArgumentError(
            f"a prompt must be a string or token ids, got {type(p).__name__}: {reprlib.repr(p)}"
        )
    return p


def _progress(total: int, enabled: bool):
    """A tqdm bar when tqdm is installed and asked for; otherwise nothing."""
    bar = None
    if enabled and total > 1:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="generate", unit="req", leave=False)
        except ImportError:
            bar = None

    def advance(n: int | None) -> None:
        if bar is None:
            return
        if n is None:
            bar.close()
        else:
            bar.update(n)

    return advance
