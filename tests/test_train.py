"""`aieng train`: a seconds-long run produces a folder that transformers loads unchanged and that
aieng generates from exactly as HF does; training resumes exactly; the trained model is the
serving model, and its training forward (dense batches, causal attention) is HF's and the
engine's."""

import io
import itertools
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from core_driver import CoreDriver
from tiny_models import ARCHITECTURES, build_checkpoint, hf_greedy, load_hf
from tokenizers import Tokenizer
from train_fixtures import tiny_config, train_tiny, write_corpus

from aieng import LLM, SamplingParams
from aieng.config.engine_args import EngineArgs
from aieng.config.engine_config import create_engine_config
from aieng.models.loader import load_model
from aieng.train.causal_lm import batch_logits, batch_loss
from aieng.train.corpus import kjv_books, read_documents, split_books, write_kjv
from aieng.train.export import hf_state_dict
from aieng.train.trainer import _encode, _eval_windows, lr_at, resume_run, train
from aieng.worker.runner import ModelRunner


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train")
    result = train_tiny(folder)
    return folder, result


def test_training_lowers_heldout_loss(trained):
    _, result = trained
    evals = [h["heldout_loss"] for h in result.history if "heldout_loss" in h]
    assert len(evals) == 2
    assert result.heldout_loss == min(evals)  # the exported checkpoint is the best evaluated
    assert result.best_step == 20 * (1 + evals.index(min(evals)))
    first_loss = result.history[0]["loss"]
    assert result.final_loss < first_loss - 1.0
    assert evals[-1] < 3.0  # the corpus is highly repetitive; a uniform guess is ln(320) = 5.8


def test_folder_is_a_hugging_face_checkpoint(trained):
    folder, result = trained
    out = folder / "model"
    names = {p.name for p in out.iterdir()}
    for required in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "training_state.pt",
        "training_log.json",
    ):
        assert required in names
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert sum(p.numel() for p in hf.parameters()) == result.parameters
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "The king went up to the city."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] == 40 and log["parameters"] == result.parameters


def test_aieng_generates_exactly_as_hf(trained):
    folder, _ = trained
    out = folder / "model"
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    llm = LLM(str(out), kv_cache_memory=4 << 20, kv_cache_dtype="float32")
    tok = llm.get_tokenizer()
    prompts = ["The king", "A shepherd went up to", "Jerusalem", "The prophet blessed the"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, result in zip(prompts, outputs, strict=True):
        expected, _ = hf_greedy(hf, tok.encode(prompt), 12)
        assert result.outputs[0].token_ids == expected, prompt
    llm.engine.check_pool_whole()


def test_trained_model_matches_hf_forward(trained):
    folder, _ = trained
    out = folder / "model"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours, config = load_model(out)
    ids = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(batch_logits(ours, ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_training_forward_matches_hf(arch, tmp_path):
    """Every family the serving model covers trains through the same forward: llama3 rope,
    Mistral's sliding window (shorter than the rows), Qwen2's q/k/v bias, Qwen3's head_dim."""
    folder = build_checkpoint(arch, tmp_path)
    hf = load_hf(folder)
    ours, config = load_model(folder)
    ids = torch.randint(0, config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(batch_logits(ours, ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
    loss = batch_loss(ours, ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ours.parameters())
    exported = hf_state_dict(ours)
    expected = hf.state_dict()
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert set(exported) == set(expected) - tied
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0)


def test_training_forward_matches_serving_forward(trained):
    """The same trained weights through the training forward (a dense batch, causal attention,
    no cache) and through the runner's paged path: a prompt scored in one prefill, and greedy
    continuations whose prompts arrive in chunks and whose tokens decode over the KV cache."""
    folder, _ = trained
    runner = ModelRunner(
        create_engine_config(
            EngineArgs(
                model=str(folder / "model"),
                block_size=4,
                kv_cache_memory=1 << 22,
                kv_cache_dtype="float32",
            )
        )
    )
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, runner.model_config.vocab_size, (2, 64), generator=generator)
    with torch.no_grad():
        logprobs = torch.log_softmax(batch_logits(runner.model, ids), dim=-1)
    for row, row_logprobs in zip(ids, logprobs, strict=True):
        scored = row_logprobs[:-1].gather(1, row[1:, None])[:, 0]
        torch.testing.assert_close(
            scored, runner.prompt_logprobs(row.tolist()), atol=1e-5, rtol=1e-5
        )

    scheduler = CoreDriver(runner, chunk_size=8)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    for length in (5, 13, 30):
        scheduler.add(ids[0, :length].tolist(), greedy)
    for request in scheduler.run():
        tokens = torch.tensor([request.tokens])
        with torch.no_grad():
            continuation = torch.log_softmax(batch_logits(runner.model, tokens)[0], dim=-1)
        predicted = continuation[len(request.prompt) - 1 : -1]  # (12, vocab)
        assert predicted.argmax(-1).tolist() == request.output
        chosen = predicted.gather(1, torch.tensor(request.output)[:, None])[:, 0]
        torch.testing.assert_close(chosen, torch.tensor(request.logprobs), atol=1e-4, rtol=0)


def test_resume_continues_exactly(tmp_path):
    straight = train_tiny(tmp_path / "a", steps=20, checkpoint_interval=10)
    cfg = tiny_config(tmp_path / "b", steps=20, checkpoint_interval=7)
    first = train(cfg, stop_after=10)  # interrupted after step 10
    assert first.steps == 10
    log = io.StringIO()
    resumed = train(cfg, resume=True, log=log)
    assert "resuming" in log.getvalue() and "at step 10/20" in log.getvalue()
    assert resumed.steps == 20
    assert resumed.final_loss == pytest.approx(straight.final_loss, abs=1e-5)
    from safetensors.torch import load_file

    a = load_file(tmp_path / "a" / "model" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-5)


OFF_DOMAIN = (
    "Quantum chromodynamics describes quarks; gluons bind them tightly.\n\n"
    "Zebras graze quietly while xylophones echo over fjords.\n\n"
    "Jovial wizards quickly box the frozen yak.\n\n"
) * 3


def test_exported_folder_is_the_best_heldout_checkpoint(tmp_path):
    # Held-out text unlike the training text: its loss dips, then rises as the model specializes.
    cfg = tiny_config(tmp_path, steps=30, eval_interval=5)
    Path(cfg.heldout).write_text(OFF_DOMAIN)
    result = train(cfg)
    evals = [(h["heldout_loss"], h["step"]) for h in result.history if "heldout_loss" in h]
    best_loss, best_step = min(evals)
    assert result.best_step == best_step and result.heldout_loss == best_loss
    assert best_step < 30, "the test needs a run whose last evaluation is not its best"
    out = tmp_path / "model"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    held = _encode(tok, read_documents(cfg.heldout), tok.token_to_id("<|endoftext|>"))
    windows = _eval_windows(held, cfg)
    with torch.no_grad():
        logits = hf(windows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    assert loss.item() == pytest.approx(best_loss, abs=1e-4)


def test_a_given_tokenizer_is_reused_byte_for_byte(trained, tmp_path):
    """`--tokenizer FILE` (a draft model shares its target's tokenizer): no tokenizer is
    trained; the folder's tokenizer.json is the given one."""
    folder, _ = trained
    given = folder / "model" / "tokenizer.json"
    train_tiny(tmp_path, tokenizer=str(given), steps=2, eval_interval=2, checkpoint_interval=2)
    assert (tmp_path / "model" / "tokenizer.json").read_bytes() == given.read_bytes()
    with pytest.raises(ValueError, match=r"--tokenizer .*: no such file"):
        train_tiny(tmp_path / "other", tokenizer=str(tmp_path / "missing.json"))


def test_resume_without_state_is_a_clear_error(tmp_path):
    cfg = tiny_config(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"training_state\.pt"):
        train(cfg, resume=True)


def test_resume_refuses_to_change_the_model_or_schedule(tmp_path):
    cfg = tiny_config(tmp_path, steps=4, checkpoint_interval=2)
    train(cfg, stop_after=2)
    with pytest.raises(ValueError, match="cannot change"):
        resume_run(cfg.out, {"lr": 1.0, "hidden_size": 8})
    assert resume_run(cfg.out, {"steps": 4}).steps == 4


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not a multiple"):
        train_tiny(tmp_path, hidden_size=60, num_heads=7)
    with pytest.raises(ValueError, match="--lr"):
        train_tiny(tmp_path, lr=0.0)
    with pytest.raises(ValueError, match="--seq-len"):
        train_tiny(tmp_path, seq_len=100_000)


def test_learning_rate_schedule(tmp_path):
    cfg = tiny_config(tmp_path, steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    values = [lr_at(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(values))


KJV_SAMPLE = """
Genesis 1

  1 In the beginning God created the heaven and the earth.
  2 And the earth was without form, and void; and darkness was upon the face of
the deep. And the Spirit of God moved upon the face of the waters.

Genesis 2

  1 Thus the heavens and the earth were finished, and all the host of them.

Ruth 1

  1 Now it came to pass in the days when the judges ruled, that there was a
famine in the land.

1 John 1

  1 That which was from the beginning, which we have heard.
"""


def test_kjv_text_is_stripped_of_headings_and_verse_numbers():
    books = kjv_books(KJV_SAMPLE)
    assert list(books) == ["Genesis", "Ruth", "1 John"]
    assert books["Genesis"][0] == (
        "In the beginning God created the heaven and the earth.\n"
        "And the earth was without form, and void; and darkness was upon the face of the deep. "
        "And the Spirit of God moved upon the face of the waters."
    )
    train_text, held = split_books(books, heldout=("Ruth",))
    assert "famine" in held and "famine" not in train_text
    assert "Genesis" not in train_text and "  1 " not in train_text
    assert train_text.count("\n\n") == 2  # three chapters


def test_documents_are_blank_line_separated(tmp_path):
    path = write_corpus(tmp_path / "c.txt", 5, seed=0)
    assert len(read_documents(path)) == 5
    with pytest.raises(RuntimeError, match="no such text file"):
        read_documents(tmp_path / "missing.txt")


@pytest.mark.skipif(
    shutil.which("bible") is None, reason="Debian's bible-kjv package is not installed"
)
def test_kjv_corpus_from_the_bible_program(tmp_path):
    train_path, held_path = write_kjv(tmp_path)
    train_text, held = train_path.read_text(), held_path.read_text()
    assert train_text.startswith("In the beginning God created the heaven and the earth.\n")
    assert held.startswith("Now it came to pass in the days when the judges ruled")  # Ruth 1:1
    assert len(read_documents(train_path)) + len(read_documents(held_path)) == 1189  # chapters
    assert 0.02 < len(held) / (len(held) + len(train_text)) < 0.05
    assert "Genesis 1" not in train_text and not re.search(r"^\s*\d+ ", train_text, re.M)
