"""SamplingParams(prompt_logprobs=k): every prompt token's log-probability (and the top k) from
the prefill's own forward, held against transformers — batched, chunked, after the prompt was
cached, with max_tokens 0 (score only) and beside ordinary requests."""

import pytest
import torch
from text_fixtures import byte_level_bpe, save_model_dir
from tiny_models import build_checkpoint, load_hf

from aieng import LLM, SamplingParams

VOCAB = 384
K = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompt_lp")
    save_model_dir(folder, byte_level_bpe(VOCAB))
    return build_checkpoint("llama", folder, vocab_size=VOCAB, initializer_range=0.05)


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(
        str(model_dir),
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_cache_memory=1 << 22,
        kv_cache_dtype="float32",
    )


def prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 40, (count,), generator=generator).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """(len - 1, vocab): row p is the distribution of prompt token p + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def check_against_hf(hf, prompt: list[int], scored, k: int = K) -> None:
    assert len(scored) == len(prompt)
    assert scored[0] is None
    expected = hf_prompt_logprobs(hf, prompt)
    for position, entry in enumerate(scored[1:]):
        token = prompt[position + 1]
        assert entry[token] == pytest.approx(expected[position, token].item(), abs=1e-4)
        top_values, top_ids = expected[position].topk(k)
        for tid, value in zip(top_ids.tolist(), top_values.tolist(), strict=True):
            if tid in entry:
                assert entry[tid] == pytest.approx(value, abs=1e-4)
            else:  # a near tie at the k-th place may pick another id
                assert value == pytest.approx(top_values[-1].item(), abs=1e-4)
        assert set(entry) - {token} <= set(expected[position].topk(k + 1).indices.tolist())


def test_prompt_logprobs_match_hf_batched_and_chunked(llm, hf):
    batch = prompts(8, seed=1)
    assert any(len(p) > 16 for p in batch)  # with 64 tokens a step, long prompts are chunked
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K)
    outputs = llm.generate(batch, params)
    for prompt, output in zip(batch, outputs, strict=True):
        check_against_hf(hf, prompt, output.prompt_logprobs)


def test_a_chunk_of_four_tokens_gives_the_same_scores(model_dir, hf):
    chunked = LLM(
        str(model_dir),
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=4,
        kv_cache_memory=1 << 22,
        kv_cache_dtype="float32",
    )
    prompt = prompts(1, seed=2)[0] + list(range(10, 30))
    out = chunked.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=K))
    check_against_hf(hf, prompt, out[0].prompt_logprobs)


def test_a_cached_prompt_is_scored_in_full_and_stays_cached(llm, hf):
    prompt = prompts(1, seed=3)[0] + list(range(40, 60))
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([prompt], plain)
    scored = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=K))[0]
    assert scored.num_cached_tokens == 0  # the scoring request read no cached prefix
    check_against_hf(hf, prompt, scored.prompt_logprobs)
    again = llm.generate([prompt], plain)[0]
    assert again.num_cached_tokens > 0  # others still hit the cache


def test_max_tokens_zero_scores_only(llm, hf):
    batch = prompts(4, seed=4)
    params = SamplingParams(max_tokens=0, prompt_logprobs=1, logprobs=1)
    outputs = llm.generate(batch, params)
    for prompt, output in zip(batch, outputs, strict=True):
        (completion,) = output.outputs
        assert completion.token_ids == [] and completion.text == ""
        assert completion.finish_reason == "length"
        assert completion.logprobs == []
        check_against_hf(hf, prompt, output.prompt_logprobs, k=1)
    llm.engine.check_pool_whole()


def test_scoring_leaves_other_requests_alone(llm):
    batch = prompts(6, seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    alone = [o.outputs[0].token_ids for o in llm.generate(batch, greedy)]
    mixed_params = [
        SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2 if i % 2 else None)
        for i in range(len(batch))
    ]
    mixed = llm.generate(batch, mixed_params)
    assert [o.outputs[0].token_ids for o in mixed] == alone
    for i, output in enumerate(mixed):
        assert (output.prompt_logprobs is None) == (i % 2 == 0)


def test_n_siblings_and_one_token_prompts(llm, hf):
    prompt = prompts(1, seed=6)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=3, prompt_logprobs=0)
    (out,) = llm.generate([prompt], params)
    assert len(out.outputs) == 3
    check_against_hf(hf, prompt, out.prompt_logprobs, k=0)
    (single,) = llm.generate([[5]], SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert single.prompt_logprobs == [None]
    llm.engine.check_pool_whole()


@pytest.mark.parametrize("bad", [-1, 1.5, "2"])
def test_bad_prompt_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
