"""A tiny checkpoint's runner held against transformers: greedy tokens and their logprobs, batched,
chunked, and after a prefix-cache hit — shared by the model-family test files."""

import torch
from core_driver import CoreDriver
from tiny_models import VOCAB_SIZE, hf_greedy, load_hf

from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.models.llama import LlamaForCausalLM
from aieng.sampling import SamplingParams
from aieng.worker.runner import ModelRunner

MAX_TOKENS = 8
BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)


class HFReference:
    """The checkpoint in `folder`, its runner, random prompts of `lengths` and HF's greedy
    continuations of them."""

    def __init__(self, folder, lengths, seed: int, **options):
        """options: further EngineArgs of the runner. The cache is float32 unless they say
        otherwise: `auto` is bfloat16 under the native CPU decoder, and these tests hold the
        tokens and logprobs identical to transformers'."""
        self.folder = folder
        self.hf = load_hf(folder)
        options = {"kv_cache_dtype": "float32", **options}
        args = EngineArgs(
            model=str(folder), block_size=BLOCK_SIZE, kv_cache_memory=1 << 22, **options
        )
        self.runner = ModelRunner(create_engine_config(args))
        generator = torch.Generator().manual_seed(seed)
        self.prompts = [
            torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths
        ]
        self.expected = [hf_greedy(self.hf, p, MAX_TOKENS) for p in self.prompts]


def check_matches(requests, expected):
    for request, (tokens, logprobs) in zip(requests, expected, strict=True):
        assert request.output == tokens
        torch.testing.assert_close(
            torch.tensor(request.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0
        )


def check_batched(reference: HFReference, chunk_size: int | None) -> None:
    scheduler = CoreDriver(reference.runner, chunk_size=chunk_size)
    requests = [scheduler.add(p, GREEDY) for p in reference.prompts]
    scheduler.run()
    check_matches(requests, reference.expected)


def check_prefix_hit(reference: HFReference, shared_blocks: int, tail: list[int]) -> None:
    """The longest prompt runs; then its first `shared_blocks` blocks + `tail` run as a hit."""
    scheduler = CoreDriver(reference.runner)
    first = scheduler.add(reference.prompts[-1], GREEDY)
    scheduler.run()
    prompt = reference.prompts[-1][: shared_blocks * BLOCK_SIZE] + tail
    request = scheduler.add(prompt, GREEDY)  # the core's prefix cache holds the shared blocks
    scheduler.run()
    assert first.num_cached_tokens == 0
    assert request.num_cached_tokens >= shared_blocks * BLOCK_SIZE
    check_matches([request], [hf_greedy(reference.hf, prompt, MAX_TOKENS)])


def as_our_parameter_names(hf_names) -> set[str]:
    """HF parameter names with q/k/v and gate/up renamed to our fused layers."""
    fused = {original: name for original, (name, _) in LlamaForCausalLM.packed_modules.items()}
    ours = set()
    for name in hf_names:
        parts = name.split(".")
        if len(parts) > 1:
            parts[-2] = fused.get(parts[-2], parts[-2])
        ours.add(".".join(parts))
    return ours
