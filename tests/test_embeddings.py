"""Embeddings (`LLM.embed`) equal sentence-transformers' on tiny random BERT, XLM-RoBERTa and
Qwen3 checkpoints (cosine >= 0.9999 per row, batched and alone), through the scheduler: chunked
prefills, explicit pooling, dimensions, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
from embedding_fixtures import EMBEDDERS, save_hf_model, save_sentence_transformer

from aieng import LLM, InvalidArgumentError, PoolingParams, SamplingParams
from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.pooling import sentence_transformers_pooling

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "Jesus wept.",
    "The quick brown fox jumps over the lazy dog; 0123456789 times! " * 2,
    "Paged attention keeps the KV cache in blocks.",
]
ENGINE = dict(kv_cache_memory=1 << 22, block_size=4)


@pytest.fixture(scope="module", params=list(EMBEDDERS))
def st_model(request, tmp_path_factory):
    from sentence_transformers import SentenceTransformer

    folder = save_sentence_transformer(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, folder, SentenceTransformer(str(folder), device="cpu")


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(1)


@pytest.mark.parametrize("batching", [{}, dict(max_num_batched_tokens=8, max_num_seqs=4)])
def test_parity_with_sentence_transformers(st_model, batching):
    """The second way splits every prompt into prefill chunks of a few tokens."""
    kind, folder, st = st_model
    reference = st.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    assert sentence_transformers_pooling(folder) is not None
    with LLM(str(folder), **batching, **ENGINE) as llm:
        batched = np.stack([o.embedding for o in llm.embed(TEXTS)])
        alone = np.stack([llm.embed(text)[0].embedding for text in TEXTS])
        llm.engine.check_pool_whole()
    for got in (batched, alone):
        cosines = _cosines(got, reference)
        assert cosines.min() >= 0.9999, (kind, cosines)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert _cosines(batched[:1], batched[1:2])[0] < 0.9999  # different texts differ


def test_checkpoint_pooling_read(st_model):
    kind, folder, _ = st_model
    mode = {"lasttoken": "last"}.get(EMBEDDERS[kind][4], EMBEDDERS[kind][4])
    assert sentence_transformers_pooling(folder) == PoolingParams(mode, normalize=True)


@pytest.fixture(scope="module")
def bare_qwen3(tmp_path_factory):
    folder = save_hf_model("qwen3", tmp_path_factory.mktemp("bare"))
    with LLM(str(folder), max_num_batched_tokens=64, max_num_seqs=8, **ENGINE) as llm:
        yield llm


def test_explicit_pooling_and_dimensions(bare_qwen3):
    llm = bare_qwen3
    with pytest.raises(InvalidArgumentError, match="pooling"):
        llm.embed("no pooling declared")
    mean = llm.embed(TEXTS[:2], pooling="mean")
    raw = llm.embed(TEXTS[:2], pooling=PoolingParams("mean", normalize=False))
    np.testing.assert_allclose(
        mean[0].embedding, raw[0].embedding / np.linalg.norm(raw[0].embedding), rtol=1e-5
    )
    short = llm.embed(TEXTS[:2], pooling="mean", dimensions=16)
    assert short[0].embedding.shape == (16,)
    head = mean[0].embedding[:16]
    np.testing.assert_allclose(short[0].embedding, head / np.linalg.norm(head), rtol=1e-5)
    for bad in (0, 65, True):
        with pytest.raises(InvalidArgumentError, match="dimensions"):
            llm.embed("x", pooling="mean", dimensions=bad)
    with pytest.raises(InvalidArgumentError, match="pooling must be one of"):
        llm.embed("x", pooling="max")
    with pytest.raises(InvalidArgumentError, match="prompt"):
        llm.embed("", pooling="mean")
    # generation still works beside embeddings, and every KV block comes back
    assert llm.generate("In the", SamplingParams(max_tokens=3, temperature=0))[0].outputs
    llm.engine.check_pool_whole()


def test_encoder_refuses_generation(tmp_path):
    folder = save_hf_model("bert", tmp_path / "bert")
    with LLM(str(folder), **ENGINE) as llm:
        with pytest.raises(InvalidArgumentError, match="no LM head"):
            llm.generate("hello", SamplingParams(max_tokens=2))
        assert llm.embed("hello", pooling="cls")[0].embedding.shape == (64,)
        assert llm.engine.runner.kv_caches == []  # no KV cache


def test_embeddings_share_steps_with_generation_and_abort_cleanly(bare_qwen3):
    """An embedding request and generation requests in the same engine steps: the embedding
    equals the one made alone, the generation equals its own greedy run alone; an embedding
    aborted halfway through its chunked prefill gives every KV block back."""
    llm, engine = bare_qwen3, bare_qwen3.engine
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone_vector = llm.embed(TEXTS[1], pooling="last")[0].embedding
    alone_text = llm.generate(TEXTS[0], greedy)[0].outputs[0].token_ids
    engine.add_request("gen", TEXTS[0], greedy)
    engine.add_request("emb", TEXTS[1], PoolingParams("last"))
    done = {o.request_id: o for o in engine.step() if o.finished}
    # one step: the embedding finished and the generation drew its first token
    assert list(done) == ["emb"] and len(engine.requests["gen"].sequences[0].token_ids) == 1
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    np.testing.assert_allclose(done["emb"].embedding, alone_vector, atol=1e-5)
    assert done["emb"].outputs[0].token_ids == []  # the core's token is never shown
    assert done["gen"].outputs[0].token_ids == alone_text
    engine.add_request("cut", TEXTS[3] * 2, PoolingParams("mean"))
    engine.step()
    assert "cut" in engine.requests  # halfway: its prompt needs more than one step's budget
    engine.abort("cut")
    engine.check_pool_whole()


def test_bundled_model_ships_mean_pooling_equal_to_sentence_transformers(tmp_path):
    """The default model's sentence-transformers files are the ones `aieng train` writes (mean
    pooling, normalised), and sentence-transformers itself embeds as `LLM().embed` does."""
    from sentence_transformers import SentenceTransformer

    from aieng.config.default_model import default_model_path
    from aieng.train.export import write_pooling_files

    folder = default_model_path()
    assert sentence_transformers_pooling(folder) == PoolingParams("mean", normalize=True)
    write_pooling_files(tmp_path, 256, "mean", 512)
    for name in ("modules.json", "1_Pooling/config.json", "sentence_bert_config.json"):
        assert (folder / name).read_text() == (tmp_path / name).read_text(), name
    reference = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, batch_size=1)
    with LLM(**ENGINE) as llm:
        got = np.stack([o.embedding for o in llm.embed(TEXTS)])
    assert _cosines(got, reference).min() >= 0.9999


def test_engine_pooling_is_the_default_of_a_model_without_one(bare_qwen3):
    """EngineArgs.pooling (`aieng serve --pooling`) pools a checkpoint that declares nothing."""
    bare = bare_qwen3.engine.model_info.model_path
    assert create_engine_config(EngineArgs(model=bare)).pooling is None
    with pytest.raises(ValueError, match="pooling must be one of"):
        EngineArgs(model=bare, pooling="max")
    with LLM(bare, pooling="last", **ENGINE) as llm:
        assert llm.engine.model_info.pooling == PoolingParams("last")
        np.testing.assert_allclose(
            llm.embed(TEXTS[1])[0].embedding,
            bare_qwen3.embed(TEXTS[1], pooling="last")[0].embedding,
            atol=1e-5,
        )


def test_a_checkpoint_pooling_comes_before_the_engine_default(st_model):
    _, folder, _ = st_model
    declared = sentence_transformers_pooling(folder)
    assert declared is not None
    other = "cls" if declared.method != "cls" else "mean"
    assert create_engine_config(EngineArgs(model=str(folder), pooling=other)).pooling == declared
