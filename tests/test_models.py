"""The runner's model path against Hugging Face transformers on tiny random checkpoints."""

import pytest
import torch
from core_driver import CoreDriver
from tiny_models import ARCHITECTURES, VOCAB_SIZE, build_checkpoint, hf_greedy, load_hf

from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.sampling import SamplingParams
from aieng.worker.runner import ModelRunner

PROMPT_LENS = [1, 3, 7, 12, 17, 25, 33, 40]
MAX_TOKENS = 8
BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)


def runner_args(folder, **options) -> EngineArgs:
    """A float32 cache (`auto` is bfloat16 under the native CPU decoder): identical to HF."""
    return EngineArgs(model=str(folder), block_size=BLOCK_SIZE, kv_cache_dtype="float32", **options)


class Reference:
    """A tiny checkpoint, its runner, and HF's greedy continuations of the test prompts."""

    def __init__(self, arch, folder):
        self.folder = build_checkpoint(arch, folder)
        self.hf = load_hf(self.folder)
        self.runner = ModelRunner(
            create_engine_config(runner_args(self.folder, kv_cache_memory=1 << 22))
        )
        generator = torch.Generator().manual_seed(1)
        self.prompts = [
            torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in PROMPT_LENS
        ]
        self.expected = [self.generate(p) for p in self.prompts]

    def generate(self, prompt):
        """-> (HF greedy tokens, their log-probabilities)."""
        return hf_greedy(self.hf, prompt, MAX_TOKENS)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def reference(request, tmp_path_factory):
    return Reference(request.param, tmp_path_factory.mktemp(request.param))


def check_matches(reference, requests, prompts=None):
    prompts = prompts or reference.prompts
    expected = (
        reference.expected
        if prompts is reference.prompts
        else [reference.generate(p) for p in prompts]
    )
    for request, (tokens, logprobs) in zip(requests, expected, strict=True):
        assert request.output == tokens
        torch.testing.assert_close(
            torch.tensor(request.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0
        )


def test_batched_greedy_matches_hf(reference):
    scheduler = CoreDriver(reference.runner)
    for prompt in reference.prompts:
        scheduler.add(prompt, GREEDY)
    check_matches(reference, scheduler.run())


@pytest.mark.parametrize("chunk_size", [1, 4, 16])
def test_chunked_prefill_matches_hf(reference, chunk_size):
    scheduler = CoreDriver(reference.runner, chunk_size=chunk_size)
    for prompt in reference.prompts:
        scheduler.add(prompt, GREEDY)
    check_matches(reference, scheduler.run())


def test_requests_joining_a_running_batch_match_hf(reference):
    # Later prompts arrive while earlier ones decode: prefills and decodes share steps.
    scheduler = CoreDriver(reference.runner, chunk_size=8)
    for prompt in reference.prompts:
        scheduler.add(prompt, GREEDY)
        scheduler.step()
    check_matches(reference, scheduler.run())


def test_prefix_cache_hit_matches_hf(reference):
    scheduler = CoreDriver(reference.runner)
    first = scheduler.add(reference.prompts[-1], GREEDY)  # 40 tokens
    scheduler.run()
    shared_blocks = 5  # 20 tokens
    prompts = [
        reference.prompts[-1][: shared_blocks * BLOCK_SIZE] + reference.prompts[i] for i in (0, 3)
    ]
    requests = [scheduler.add(p, GREEDY) for p in prompts]  # the core's prefix cache hits
    scheduler.run()
    assert first.num_cached_tokens == 0
    assert [r.num_cached_tokens for r in requests] == [shared_blocks * BLOCK_SIZE] * 2
    check_matches(reference, requests, prompts)


def test_greedy_rows_unaffected_by_sampled_rows(reference):
    scheduler = CoreDriver(reference.runner)
    greedy = []
    for i, prompt in enumerate(reference.prompts):
        greedy.append(scheduler.add(prompt, GREEDY))
        sampled = SamplingParams(
            temperature=0.8,
            top_k=20,
            top_p=0.9,
            min_p=0.05,
            seed=i,
            max_tokens=MAX_TOKENS,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            logprobs=3,
        )
        scheduler.add(prompt, sampled)
    requests = scheduler.run()
    check_matches(reference, greedy)
    for request in requests:
        assert len(request.output) == MAX_TOKENS
        assert all(0 <= t < VOCAB_SIZE for t in request.output)


def test_top_logprobs_match_hf(reference):
    scheduler = CoreDriver(reference.runner)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)
    request = scheduler.add(reference.prompts[4], params)
    scheduler.run()
    prompt = torch.tensor([reference.prompts[4] + request.output[:-1]])
    with torch.no_grad():
        logits = reference.hf(prompt).logits[0, len(reference.prompts[4]) - 1 :]
    values, ids = torch.log_softmax(logits, -1).topk(5, dim=-1)
    for step, top in enumerate(request.top_logprobs):
        assert list(top) == ids[step].tolist()
        torch.testing.assert_close(
            torch.tensor(list(top.values())), values[step], atol=1e-4, rtol=0
        )


def test_seeded_request_reproduces_in_any_batch(reference):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=MAX_TOKENS)
    alone = CoreDriver(reference.runner)
    expected = alone.add(reference.prompts[5], seeded)
    alone.run()
    crowd = CoreDriver(reference.runner, chunk_size=6)
    for prompt in reference.prompts[:3]:
        crowd.add(prompt, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS))
        crowd.step()  # the seeded request's tokens come at other steps than when alone
    request = crowd.add(reference.prompts[5], seeded)
    crowd.add(reference.prompts[6], SamplingParams(seed=42, max_tokens=MAX_TOKENS))
    crowd.run()
    assert request.output == expected.output


def test_step_without_samples_returns_nothing(reference):
    scheduler = CoreDriver(reference.runner, chunk_size=4)
    request = scheduler.add(reference.prompts[-1], GREEDY)
    scheduler.step()  # a partial prefill (4 of its 40 tokens): no row samples
    assert request.output == [] and len(request.prompt) > 4
    scheduler.run()
    assert request.output == reference.expected[-1][0]


def test_kv_cache_is_sized_from_the_budget(reference):
    runner = reference.runner
    config = runner.model_config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert runner.block_bytes == per_token * BLOCK_SIZE
    assert runner.num_blocks == (1 << 22) // runner.block_bytes
    k_cache, v_cache = runner.kv_caches[0]
    expected = (runner.num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    assert k_cache.shape == v_cache.shape == expected
    assert len(runner.kv_caches) == config.num_hidden_layers
    with pytest.raises(ValueError, match=r"kv_cache_memory: a budget of .* holds no KV block"):
        ModelRunner(
            create_engine_config(
                runner_args(reference.folder, kv_cache_memory=runner.block_bytes - 1)
            )
        )
