"""The draft_model proposer: a smaller checkpoint sharing the target's tokenizer proposes, and
the output is exactly plain decoding's — greedy token for token (a tiny random draft with
chunked prefill, prefix hits and preemption; the target as its own draft, accepted every
time; the draft shipped for the default model), sampled in distribution when the verifier
takes the draft's q (rejection sampling, a tiny vocabulary) — and the block pool ends whole.
A draft with another vocabulary or tokenizer, and bad numbers, are refused by name."""

import argparse
import json

import numpy as np
import pytest
import torch
from test_spec_decode_sampling import FIRST, PENALISED, PLAIN, VOCAB, N, distance, table, to_host
from test_spec_decode_sampling import plain_samples as plain_first_second
from text_fixtures import byte_level_bpe, save_model_dir
from tiny_models import build_checkpoint

from aieng import LLM, SamplingParams
from aieng.cli import build_parser
from aieng.config.engine_args import EngineArgs
from aieng.config.speculative import SHIPPED_DRAFT_PATH, SHIPPED_DRAFT_TOKENS
from aieng.worker.isolated_sampling import RowRules
from aieng.worker.sampler import Sampler
from aieng.worker.spec_verify import verify_and_sample

TINY_VOCAB = 384
K = 3
PROMPTS = [
    "the cat sat on the mat and the cat sat on the mat and the",
    "In the beginning God created the heaven and the earth.",
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny llama target, a 1-layer random draft with its tokenizer, and a draft whose
    tokenizer has another vocabulary size."""
    root = tmp_path_factory.mktemp("draft")
    tokenizer = byte_level_bpe(TINY_VOCAB)
    folders = {name: root / name for name in ("target", "draft", "other")}
    for name in ("target", "draft"):
        save_model_dir(folders[name], tokenizer)
    build_checkpoint("llama", folders["target"], vocab_size=TINY_VOCAB)
    build_checkpoint("llama", folders["draft"], seed=7, vocab_size=TINY_VOCAB, num_hidden_layers=1)
    save_model_dir(folders["other"], byte_level_bpe(300))
    build_checkpoint("llama", folders["other"], vocab_size=300, num_hidden_layers=1)
    return folders


def engine(target, draft=None, **options) -> LLM:
    options.setdefault("kv_cache_memory", 1 << 22)
    spec = None
    if draft is not None:  # speculating at every batch size, not only the CPU's measured 1
        spec = {"model": str(draft), "num_speculative_tokens": K, "disable_by_batch_size": 0}
    return LLM(str(target), block_size=4, speculative_config=spec, **options)


def tokens_of(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


# ------------------------------------------------------------------ greedy: exact


def test_greedy_with_a_draft_is_plain_decoding_with_chunks_prefix_hits_and_preemption(models):
    plain = tokens_of(engine(models["target"]).generate(PROMPTS, GREEDY, use_tqdm=False))
    # 2 layers x 2 KV heads x 16 dims x 2 x 2 bytes (bfloat16: the CPU's default cache) x 4
    # tokens = 1 KiB a target block, and the 1-layer draft's 512 bytes beside it: 20 blocks'
    # worth forces preemption.
    for options in ({}, {"long_prefill_token_threshold": 3}, {"kv_cache_memory": 20 * 1536}):
        llm = engine(models["target"], models["draft"], **options)
        for _ in range(1 if options else 2):  # the second time the prompts are cache hits
            assert tokens_of(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain, options
        stats = llm.get_stats()
        assert stats.spec_decode_num_draft_tokens > 0, options
        if "kv_cache_memory" in options:
            assert stats.num_preemptions > 0
        elif not options:
            assert stats.prefix_cache_hits > 0
        llm.engine.check_pool_whole()


def test_the_target_as_its_own_draft_is_accepted_every_time(models):
    """The draft's KV cache over the target's block table is right: the same weights
    propose exactly what the target takes, through chunks and preemption."""
    plain = tokens_of(engine(models["target"]).generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = engine(
        models["target"], models["target"], long_prefill_token_threshold=5,
        kv_cache_memory=20 * 2048,
    )  # fmt: skip
    assert tokens_of(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decode_num_draft_tokens > 20
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    llm.engine.check_pool_whole()


def test_a_random_draft_still_gives_seeded_samples_exactly(models):
    """A bad draft (random weights, acceptance about 0) changes nothing: seeded sampled
    requests give the same tokens as plain decoding (their drafts are point masses)."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=16)
    plain = tokens_of(engine(models["target"]).generate(PROMPTS, params, use_tqdm=False))
    llm = engine(models["target"], models["draft"])
    assert tokens_of(llm.generate(PROMPTS, params, use_tqdm=False)) == plain
    llm.engine.check_pool_whole()


def test_unseeded_sampling_with_a_draft_runs_and_leaves_the_pool_whole(models):
    params = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, n=2)
    llm = engine(models["target"], models["target"])
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(t) == 16 for t in tokens_of(outputs))
    stats = llm.get_stats()
    # The target drafting for itself at the same temperature: q = p (to rounding), so every
    # draft is accepted but for a rare rounding loss.
    drafted = stats.spec_decode_num_draft_tokens
    assert drafted > 0 and stats.spec_decode_num_accepted_tokens >= 0.97 * drafted
    llm.engine.check_pool_whole()


# ------------------------------------------------------------------ sampled: q


def draft_samples(params, q: np.ndarray, seed: int = 0):
    """Every request verifies one draft drawn from q: (its drafts, first tokens, second
    tokens of the requests whose draft was accepted and was token 2)."""
    rng = np.random.default_rng(seed)
    draft = rng.choice(VOCAB, size=N, p=q)
    slots = np.repeat(np.arange(N), 2)
    second_logits = torch.tensor([0.3, 0.2, 1.5, 1.1, 0.0, -0.3, 0.8, -1.0])
    logits = torch.stack([FIRST, second_logits]).repeat(N, 1)
    drafts = np.stack([draft, np.full(N, -1)], axis=1).reshape(-1)
    groups = (np.arange(0, 2 * N, 2), np.full(N, 2))
    proposals = (np.arange(0, 2 * N, 2), np.tile(q.astype(np.float32), (N, 1)))
    tokens, taken, _, failed = verify_and_sample(
        Sampler(seed=3), table(params), logits, slots, drafts, groups, RowRules(), to_host,
        proposals,
    )  # fmt: skip
    assert not failed and set(taken.tolist()) <= {1, 2}
    starts = np.r_[0, np.cumsum(taken)[:-1]]
    first = tokens[starts]
    accepted = taken == 2
    assert np.array_equal(accepted, first == draft), "accepted exactly when it kept the draft"
    return draft, first, tokens[starts[accepted & (draft == 2)] + 1]


@pytest.mark.parametrize("params", [PENALISED, PLAIN], ids=["penalty", "one-pass"])
def test_rejection_sampling_against_q_draws_plain_decodings_distribution(params):
    q = np.array([0.05, 0.05, 0.5, 0.05, 0.2, 0.05, 0.05, 0.05])  # unlike p: rejections
    draft, spec_first, spec_second = draft_samples(params, q)
    plain_first, plain_second = plain_first_second(params)
    assert distance(spec_first, plain_first) < 0.04
    assert len(spec_second) > 500
    assert distance(spec_second, plain_second) < 0.08
    # Acceptance is sum(min(p, q)) (p from the plain samples), above the point-mass rule's
    # sum(p * q): the verifier really used q.
    p = np.bincount(plain_first, minlength=VOCAB) / N
    acceptance = float(np.mean(spec_first == draft))
    assert abs(acceptance - np.minimum(p, q).sum()) < 0.03
    assert acceptance > (p * q).sum() + 0.1
    # The test tells distributions apart: the drafts themselves are far from plain decoding.
    assert distance(draft, plain_first) > 0.1


# ------------------------------------------------------------------ the shipped draft


def test_the_shipped_draft_on_the_default_model_is_exact_and_accepted():
    prompts = ["And God said", "And it came to pass"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = tokens_of(LLM(kv_cache_memory=1 << 24).generate(prompts, params, use_tqdm=False))
    llm = LLM(
        kv_cache_memory=1 << 24,
        speculative_config={
            "model": "default-draft",
            "num_speculative_tokens": 4,
            "disable_by_batch_size": 0,
        },
    )
    assert tokens_of(llm.generate(prompts, params, use_tqdm=False)) == plain
    stats = llm.get_stats()
    # The shipped draft is weak (0.16 of its drafts accepted in the bench), but a draft that
    # proposed at random would match the target about once in 4,096.
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_accepted_per_position[0] >= 2
    llm.engine.check_pool_whole()


def test_the_word_draft_on_the_command_line_is_the_shipped_draft():
    args = build_parser().parse_args(["generate", "--speculative", "draft", "And God said"])
    assert args.speculative_config == {
        "model": "default-draft",
        "num_speculative_tokens": SHIPPED_DRAFT_TOKENS,
    }
    assert (SHIPPED_DRAFT_PATH / "model.safetensors").is_file()
    assert (SHIPPED_DRAFT_PATH / "tokenizer.json").is_file()


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"model": "x", "num_speculative_tokens": 0}, "'num_speculative_tokens' must be"),
        ({"model": "x", "num_speculative_tokens": 17}, "'num_speculative_tokens' must be"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "draft_model needs 'model'"),
        ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "'eagle' is unknown"),
        ({"model": 3, "num_speculative_tokens": 2}, "'model' must be a string"),
    ],
)
def test_bad_draft_configs_are_refused_by_name(spec, match):
    with pytest.raises(ValueError, match="speculative_config") as error:
        EngineArgs(speculative_config=spec)
    assert match in str(error.value)


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused_by_name(models, tmp_path):
    with pytest.raises(ValueError, match="draft's vocabulary has 300 tokens, the target's 384"):
        engine(models["target"], models["other"])
    # Same vocabulary size, another tokenizer: one merge differs.
    other = tmp_path / "retokenized"
    save_model_dir(other, byte_level_bpe(TINY_VOCAB))
    data = json.loads((other / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][::-1]
    (other / "tokenizer.json").write_text(json.dumps(data))
    build_checkpoint("llama", other, vocab_size=TINY_VOCAB, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"the draft.s tokenizer .* differs"):
        engine(models["target"], other)
    with pytest.raises(ValueError, match="no checkpoint"):
        engine(models["target"], tmp_path / "missing")


def test_a_draft_under_tensor_parallelism_is_refused_by_name(models):
    with pytest.raises(ValueError, match="draft model runs only without tensor parallelism"):
        engine(models["target"], models["draft"], tensor_parallel_size=2)


def test_the_flag_takes_a_draft_as_json():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, only=["speculative_config"])
    spec = {"model": "path/to/draft", "num_speculative_tokens": 4}
    args = parser.parse_args(["--speculative-config", json.dumps(spec)])
    assert EngineArgs.from_cli_args(args).speculative_config == spec
