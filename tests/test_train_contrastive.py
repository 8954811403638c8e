"""`aieng train --objective contrastive`: the InfoNCE objective lowers its loss; the exported
folder is an embedding model that aieng pools as trained (sentence-transformers' files), with
embeddings equal to a pure-torch (transformers) forward of the same weights; the CLI runs it."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer
from train_fixtures import tiny_config, write_corpus

from aieng import LLM
from aieng.config.model_config import ModelConfig
from aieng.pooling import sentence_transformers_pooling
from aieng.train.bpe import train_tokenizer
from aieng.train.causal_lm import new_model
from aieng.train.contrastive import ContrastiveObjective, embed_ids, info_nce
from aieng.train.corpus import read_documents
from aieng.train.pairs import PairSampler
from aieng.train.trainer import train

TEXTS = [
    "The king went up to the city.",
    "A shepherd looked upon the river by night",
    "my son",
    "The prophet spake unto the people in the morning; and he was glad.",
]


def contrastive_config(folder, **overrides):
    settings = dict(objective="contrastive", batch_size=8, steps=12, eval_interval=6,
                    eval_windows=16, checkpoint_interval=6, log_interval=3, lr=2e-3)  # fmt: skip
    return tiny_config(folder, **{**settings, **overrides})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cfg = contrastive_config(tmp_path_factory.mktemp("contrastive"))
    return cfg, train(cfg)


def test_objective_lowers_its_loss(tmp_path):
    """A fresh tiny model fits a fixed batch of pairs from the synthetic corpus."""
    cfg = contrastive_config(tmp_path)
    torch.manual_seed(0)
    tokenizer = train_tokenizer(read_documents(cfg.data), cfg.vocab_size)
    shape = cfg.shape(tokenizer.get_vocab_size())
    model = new_model(ModelConfig.from_dicts(shape.hf_config(0, 0)), shape.initializer_range)
    objective = ContrastiveObjective(cfg, tokenizer, 0, read_documents(cfg.data), [])
    batch = objective.pairs.sample(8, torch.Generator().manual_seed(0), negatives=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = objective.batch_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses


def test_info_nce_is_low_for_matching_pairs_and_symmetric():
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(6, 16), dim=-1)
    far = torch.nn.functional.normalize(torch.randn(6, 16), dim=-1)
    assert info_nce(q, q, None, 0.05) < 0.01
    assert info_nce(q, far, None, 0.05) > 1.0
    assert torch.isclose(info_nce(q, far, None, 0.1), info_nce(far, q, None, 0.1))
    # a hard negative equal to the positive halves the chance of the right passage
    assert abs(info_nce(q, q, q, 1e-3).item() - np.log(2) / 2) < 1e-3


def test_pairs_hold_the_query_verse_and_negatives_do_not():
    doc = "\n".join(f"line{i} alpha beta gamma delta epsilon" for i in range(9))
    sampler = PairSampler([doc, "only one line here today"], window=3, query_drop=0.3)
    batch = sampler.sample(64, torch.Generator().manual_seed(0), negatives=True)
    assert batch.negatives is not None
    for query, passage, negative in zip(batch.queries, batch.passages, batch.negatives,
                                        strict=True):  # fmt: skip
        if query.startswith("line"):  # the line's tag survived the word drop
            tag = query.split()[0]
            assert tag in passage.split() and tag not in negative.split()
        assert 3 <= len(query.split())


def test_training_exports_an_embedding_model(trained):
    _, result = trained
    assert result.heldout_loss is not None and result.best_step in (6, 12)
    out = result.out
    modules = json.loads((out / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling",
                                                               "Normalize"]  # fmt: skip
    pooling = json.loads((out / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"] is True and pooling["word_embedding_dimension"] == 64
    assert not any(v for k, v in pooling.items() if k.startswith("pooling_") and "mean_t" not in k)
    declared = sentence_transformers_pooling(out)
    assert declared is not None and (declared.method, declared.normalize) == ("mean", True)
    log = json.loads((out / "training_log.json").read_text())
    assert log["config"]["objective"] == "contrastive"


def test_aieng_embeds_as_a_torch_forward_of_the_weights(trained):
    _, result = trained
    rows = _aieng_embeddings(result.out, TEXTS)
    reference = _transformers_embeddings(result.out, TEXTS, "mean")
    _assert_parity(rows, reference)
    # the encoder trained is the encoder served: the training forward pools the same vectors
    model = _training_model(result.out)
    tokenizer = Tokenizer.from_file(str(result.out / "tokenizer.json"))
    ids = [e.ids for e in tokenizer.encode_batch(TEXTS)]
    with torch.no_grad():
        _assert_parity(rows, embed_ids(model, ids, "mean", 0).numpy())


def test_last_token_pooling_exports_and_embeds(tmp_path):
    cfg = contrastive_config(tmp_path, pooling="last", steps=2, eval_interval=2)
    result = train(cfg)
    declared = sentence_transformers_pooling(result.out)
    assert declared is not None and declared.method == "last"
    rows = _aieng_embeddings(result.out, TEXTS)
    _assert_parity(rows, _transformers_embeddings(result.out, TEXTS, "last"))


def test_init_from_starts_at_the_checkpoint(trained, tmp_path):
    _, first = trained
    cfg = contrastive_config(tmp_path, init_from=str(first.out), steps=1, lr=1e-9,
                             warmup_steps=1, hidden_size=32)  # fmt: skip
    result = train(cfg)
    config = json.loads((result.out / "config.json").read_text())
    assert config["hidden_size"] == 64  # the checkpoint's shape, not --hidden-size
    assert (result.out / "tokenizer.json").read_text() == (first.out / "tokenizer.json").read_text()
    _assert_parity(_aieng_embeddings(result.out, TEXTS), _aieng_embeddings(first.out, TEXTS))


def test_bad_contrastive_settings_are_refused(tmp_path):
    for overrides, fragment in (
        ({"objective": "masked"}, "--objective"),
        ({"pooling": "cls"}, "--pooling"),
        ({"temperature": 0.0}, "--temperature"),
        ({"query_drop": 1.0}, "--query-drop"),
    ):
        with pytest.raises(ValueError, match=fragment):
            train(contrastive_config(tmp_path, **overrides))
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        train(contrastive_config(tmp_path, init_from=str(tmp_path)))


def test_cli_trains_a_contrastive_model(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", 60, seed=3)
    out = tmp_path / "model"
    args = ["--objective", "contrastive", "--pooling", "mean", "--temperature", "0.1",
            "--vocab-size", "300", "--hidden-size", "32", "--num-layers", "1", "--num-heads",
            "2", "--num-kv-heads", "2", "--intermediate-size", "64", "--seq-len", "64",
            "--batch-size", "4", "--steps", "3", "--threads", "1",
            "--log-interval", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "aieng", "train", "--data", str(corpus), "--out", str(out), *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "contrastive objective" in done.stderr and "pairs/s" in done.stderr
    assert "trained" in done.stdout
    assert (out / "modules.json").is_file() and (out / "1_Pooling" / "config.json").is_file()
    vector = _aieng_embeddings(out, ["The king"])[0]
    assert vector.shape == (32,) and np.isclose(np.linalg.norm(vector), 1.0, atol=1e-5)


# ---------------------------------------------------------------------------------- helpers


def _aieng_embeddings(folder, texts) -> np.ndarray:
    llm = LLM(str(folder), dtype="float32")
    try:
        return np.stack([o.embedding for o in llm.embed(texts)])
    finally:
        llm.shutdown()


def _transformers_embeddings(folder, texts, pooling: str) -> np.ndarray:
    """transformers' LlamaModel on the exported folder, each text alone, pooled by hand."""
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            hidden = model(input_ids=ids).last_hidden_state[0]  # (L, hidden)
            pooled = hidden.mean(0) if pooling == "mean" else hidden[-1]
            rows.append(torch.nn.functional.normalize(pooled, dim=0).numpy())
    return np.stack(rows)


def _training_model(folder):
    from aieng.models.llama import LlamaForCausalLM
    from aieng.models.loader import load_weights

    config = json.loads((folder / "config.json").read_text())
    model = LlamaForCausalLM(ModelConfig.from_dicts(config), torch.float32)
    load_weights(model, folder)
    return model.eval()


def _assert_parity(rows: np.ndarray, reference: np.ndarray) -> None:
    assert rows.shape == reference.shape
    cosine = (rows * reference).sum(1) / (
        np.linalg.norm(rows, axis=1) * np.linalg.norm(reference, axis=1)
    )
    assert cosine.min() >= 0.9999, cosine


def test_contrastive_run_resumes_exactly(tmp_path):
    straight = train(contrastive_config(tmp_path / "a", steps=4, checkpoint_interval=2))
    stopped_cfg = contrastive_config(tmp_path / "b", steps=4, checkpoint_interval=2)
    train(stopped_cfg, stop_after=2)
    resumed = train(stopped_cfg, resume=True)
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history]
    _assert_parity(_aieng_embeddings(resumed.out, TEXTS), _aieng_embeddings(straight.out, TEXTS))
