"""logit_bias (OpenAI's), allowed_token_ids and bad_words (vLLM's): in the library, in the
sampler, and through the server with the official openai client."""

import httpx
import numpy as np
import pytest
import torch
from server_fixtures import MODEL_NAME, ThreadServer, make_model_dir

from aieng import LLM, SamplingParams
from aieng.worker.sampler import allow_only

VOCAB = 384


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("bias"))


@pytest.fixture(scope="module")
def llm(model):
    engine = LLM(str(model), kv_cache_memory=1 << 22, block_size=4)
    yield engine
    engine.engine.check_pool_whole()


def greedy(**extra):
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0, **extra)


def test_params_are_validated():
    for bad, message in [
        ({"logit_bias": {5: 101.0}}, r"\[-100, 100\]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "finite"),
        ({"logit_bias": [1, 2]}, "dict"),
        ({"allowed_token_ids": []}, "non-empty"),
        ({"allowed_token_ids": [3, -2]}, "allowed_token_ids"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)
    assert SamplingParams(allowed_token_ids=[9, 3, 9]).allowed_token_ids == [3, 9]


def test_a_large_bias_forces_a_token_and_a_ban_removes_one(llm):
    prompt = [5, 17, 42, 9]
    [plain] = llm.generate([prompt], greedy(), use_tqdm=False)
    first = plain.outputs[0].token_ids[0]
    [forced] = llm.generate([prompt], greedy(logit_bias={77: 100.0}), use_tqdm=False)
    assert forced.outputs[0].token_ids == [77] * 8
    [banned] = llm.generate([prompt], greedy(logit_bias={first: -100.0}), use_tqdm=False)
    assert banned.outputs[0].token_ids[0] != first
    # reported logprobs are the model's, before the bias (as penalties are)
    assert forced.outputs[0].logprobs[0][77] < 0


def test_allowed_token_ids_restrict_every_draw_and_only_their_rows(llm):
    prompt = [5, 17, 42, 9]
    allowed = [11, 12, 13]
    sampled = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=1)
    params = [
        greedy(allowed_token_ids=allowed),
        SamplingParams(**{**vars(sampled), "allowed_token_ids": allowed}),
        greedy(),
    ]
    outs = llm.generate([prompt] * 3, params, use_tqdm=False)
    assert set(outs[0].outputs[0].token_ids) <= set(allowed)
    assert set(outs[1].outputs[0].token_ids) <= set(allowed)
    [alone] = llm.generate([prompt], greedy(), use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone.outputs[0].token_ids  # untouched neighbour


def test_allow_only_masks_just_the_named_rows():
    logits = torch.zeros(3, 5)
    rows, ids = torch.tensor([0, 0, 2]), torch.tensor([1, 3, 4])
    masked = allow_only(logits, rows, ids)
    assert torch.isinf(masked[0, [0, 2, 4]]).all() and (masked[0, [1, 3]] == 0).all()
    assert (masked[1] == 0).all()
    assert torch.isinf(masked[2, :4]).all() and masked[2, 4] == 0


def test_the_engine_checks_ids_against_the_vocabulary(llm):
    from aieng import AiengError

    for params in (greedy(logit_bias={VOCAB: 1.0}), greedy(allowed_token_ids=[VOCAB + 5])):
        with pytest.raises(AiengError, match="outside the vocabulary"):
            llm.generate([[5, 6]], params, use_tqdm=False)


def test_through_the_server_with_the_openai_client(model):
    openai = pytest.importorskip("openai")
    with ThreadServer(model) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        forced = client.completions.create(
            model=MODEL_NAME, prompt=[5, 17, 42], max_tokens=4, temperature=0,
            logit_bias={"77": 100}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        restricted = client.completions.create(
            model=MODEL_NAME, prompt=[5, 17, 42], max_tokens=6, temperature=1.0, seed=2,
            extra_body={"allowed_token_ids": [11, 12], "ignore_eos": True},
        )  # fmt: skip
        text = forced.choices[0].text
        ids = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "prompt": text})
    assert ids.json()["tokens"] == [77] * 4
    assert restricted.usage.completion_tokens == 6


def test_bad_words_are_never_generated(llm):
    tokenizer = llm.engine.tokenizer
    prompt = [5, 17, 42, 9]
    [plain] = llm.generate([prompt], greedy(), use_tqdm=False)
    text, ids = plain.outputs[0].text, list(plain.outputs[0].token_ids)

    # a bad word the greedy output contains, tokenized back to the same ids: two tokens where
    # some pair round-trips (the prefix rule), else one
    def round_trips(seq):
        return tokenizer.encode(tokenizer.decode(seq), add_special_tokens=False) == seq

    pairs = [ids[i : i + 2] for i in range(len(ids) - 1) if round_trips(ids[i : i + 2])]
    singles = [[t] for t in ids if round_trips([t])]
    word = tokenizer.decode((pairs or singles)[0])
    assert word.strip(), (ids, word)
    [clean] = llm.generate([prompt], greedy(bad_words=[word]), use_tqdm=False)
    banned = [tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word.lstrip())]
    out = clean.outputs[0].token_ids
    for seq in banned:
        for i in range(len(out) - len(seq) + 1):
            assert out[i : i + len(seq)] != seq, (seq, out)
    assert clean.outputs[0].token_ids != ids and word in text
    with pytest.raises(ValueError, match="non-blank"):
        SamplingParams(bad_words=["  "])


def test_a_multi_token_bad_word_bans_its_last_token_only_after_its_prefix():
    from aieng.worker.sampler import SamplingTable

    table = SamplingTable(vocab_size=16)
    table.add_request(2, greedy(), [1, 1], bad_words_ids=[[3, 4], [9], [5, 6, 7]])

    def banned():
        batch = table.batch(np.array([2]))
        return sorted(batch.blocked_ids.tolist()) if batch.blocked_ids is not None else []

    assert banned() == [9]
    table.append_tokens(np.array([2]), np.array([3]))
    assert banned() == [4, 9]
    table.append_tokens(np.array([2]), np.array([5]))
    assert banned() == [9]
    table.append_tokens(np.array([2]), np.array([6]))
    assert banned() == [7, 9]
    table.remove_request(2)
    table.add_request(2, greedy(), [1])  # the slot reused without bad words
    assert banned() == []
