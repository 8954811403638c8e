"""`aieng eval`: sliding-window perplexity through the engine's forward path, against HF."""

import math

import pytest
import torch
from text_fixtures import byte_level_bpe, save_model_dir
from tiny_models import build_checkpoint, load_hf

from aieng import InvalidArgumentError
from aieng._core import Tokenizer
from aieng.benchmarks.evaluate import perplexity, sliding_windows

VOCAB = 384
TEXT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, "
    "and void; and darkness was upon the face of the deep. 日本語 and emoji 🙂 as well.\n"
) * 12


def hf_perplexity(hf, ids: list[int], window: int, stride: int) -> float:
    """The recipe from transformers' perplexity guide, written out: labels of the tokens the
    previous window scored are masked with -100; loss is summed, not averaged per window."""
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        target_len = end - prev_end
        inputs = torch.tensor([ids[begin:end]])
        labels = inputs.clone()
        labels[:, :-target_len] = -100
        with torch.no_grad():
            logits = hf(inputs).logits[0, :-1]
        shifted = labels[0, 1:]
        mask = shifted != -100
        loss = torch.nn.functional.cross_entropy(logits[mask], shifted[mask], reduction="sum")
        total, count = total + loss.item(), count + int(mask.sum())
        prev_end = end
        if end == len(ids):
            break
    return math.exp(total / count)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval")
    save_model_dir(folder, byte_level_bpe(VOCAB))
    return build_checkpoint("llama", folder, vocab_size=VOCAB, initializer_range=0.05)


@pytest.mark.parametrize(("window", "stride"), [(64, 32), (100, 100), (256, 128), (48, 7)])
def test_perplexity_matches_hf(model_dir, tmp_path, window, stride):
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    ids = Tokenizer.from_dir(str(model_dir)).encode(TEXT, add_special_tokens=True)
    assert len(ids) > window
    ours = perplexity(model_dir, text_file, window=window, stride=stride, kv_cache_dtype="float32")
    expected = hf_perplexity(load_hf(model_dir), ids, window, stride)
    unscored = 1 if stride < window else math.ceil(len(ids) / window)
    assert ours.tokens == len(ids) - unscored
    assert ours.perplexity == pytest.approx(expected, rel=1e-3)


def test_windows_score_every_token_once():
    for n, window, stride in [(10, 4, 2), (100, 16, 15), (17, 16, 5), (5, 8, 4), (2, 2, 1)]:
        scored = []
        for begin, end, first in sliding_windows(n, window, stride):
            assert end - begin <= window and begin < first <= end
            scored += range(first, end)
        assert scored == list(range(1, n))
    # stride == window: disjoint windows, each one's first token has no context
    scored = [t for b, e, f in sliding_windows(40, 16, 16) for t in range(f, e)]
    assert scored == [t for t in range(1, 40) if t % 16 != 0]


def test_bad_windows_and_inputs(model_dir, tmp_path):
    with pytest.raises(InvalidArgumentError, match="stride"):
        sliding_windows(10, 4, 5)
    with pytest.raises(InvalidArgumentError, match="window"):
        sliding_windows(10, 1, 1)
    text_file = tmp_path / "t.txt"
    text_file.write_text(TEXT)
    with pytest.raises(InvalidArgumentError, match="exceeds the model's context"):
        perplexity(model_dir, text_file, window=10_000)
    with pytest.raises(FileNotFoundError, match="no such text file"):
        perplexity(model_dir, tmp_path / "missing.txt")
    (tmp_path / "one.txt").write_text("a")
    with pytest.raises(InvalidArgumentError, match="at least 2"):
        perplexity(model_dir, tmp_path / "one.txt")
