"""The `aieng` command end to end, as subprocesses, on the bundled default model."""

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from train_fixtures import write_corpus

from aieng import LLM, SamplingParams
from aieng.config.default_model import default_model_path

COMMANDS = ("generate", "chat", "train", "eval", "bench", "serve")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
ENV.pop("AIENG_DEBUG", None)


def aieng(*args: str, stdin: str | None = None, timeout: float = 240):
    return subprocess.run(
        [sys.executable, "-m", "aieng", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


def assert_clean_error(done, *fragments: str, code: int = 1):
    assert done.returncode == code, done
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 if code == 1 else len(lines) >= 1, done.stderr
    for fragment in fragments:
        assert fragment in done.stderr


@pytest.fixture(scope="module")
def hf_default():
    folder = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(folder)


def hf_greedy_text(hf_default, prompt: str, max_new_tokens: int) -> str:
    model, tok = hf_default
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_help_lists_every_command_and_each_has_help():
    done = aieng("--help")
    assert done.returncode == 0
    for command in COMMANDS:
        assert command in done.stdout
    for command in COMMANDS:
        sub = aieng(command, "--help")
        assert sub.returncode == 0, sub.stderr
        assert "usage: aieng " + command in sub.stdout
        assert "--" in sub.stdout
    load_test = aieng("bench", "--serve", "--help")
    assert load_test.returncode == 0 and "usage: aieng bench --serve" in load_test.stdout
    assert "--rate" in load_test.stdout and "--duration" in load_test.stdout


def test_generate_greedy_matches_hf(hf_default):
    prompt = "In the beginning"
    expected = hf_greedy_text(hf_default, prompt, 16)
    plain = aieng("generate", prompt, "--temperature", "0", "--max-tokens", "16", "--no-echo")
    assert plain.returncode == 0, plain.stderr
    # Special tokens are skipped in the text; HF ignores EOS here, aieng stops at it.
    assert expected.startswith(plain.stdout.rstrip("\n")) and plain.stdout.strip()
    streamed = aieng(
        "generate", prompt, "--temperature", "0", "--max-tokens", "16", "--stream", "--stats"
    )
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == prompt + plain.stdout
    assert "tok/s" in streamed.stderr


def test_generate_sampling_is_seeded():
    # --seed is the engine's seed (EngineArgs.seed): it seeds the sampling of this request.
    args = ("generate", "And God said", "--max-tokens", "12", "--no-echo", "--seed")
    first, second, other = aieng(*args, "7"), aieng(*args, "7"), aieng(*args, "8")
    assert first.returncode == 0 and first.stdout == second.stdout
    assert other.returncode == 0 and other.stdout != first.stdout


def test_library_default_model_matches_hf(hf_default):
    llm = LLM()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [out] = llm.generate("And the LORD spake unto Moses", params, use_tqdm=False)
    model, tok = hf_default
    ids = tok("And the LORD spake unto Moses", return_tensors="pt").input_ids
    expected = model.generate(
        ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert out.outputs[0].token_ids == expected[0, ids.shape[1] :].tolist()


def test_errors_are_one_line_without_traceback(tmp_path):
    assert_clean_error(
        aieng("generate", "hi", "--model", str(tmp_path / "nope")), "model folder not found"
    )
    assert_clean_error(aieng("generate", "hi", "--model", str(tmp_path)), "no config.json")
    assert_clean_error(aieng("eval", str(tmp_path / "missing.txt")), "no such text file")
    assert_clean_error(aieng("generate", "hi", "--temperature", "-1"), "temperature", code=2)
    assert_clean_error(aieng("generate", "hi", "--top-p", "nan"), "top-p", code=2)
    assert_clean_error(aieng("train", "--data", "x.txt"), "--out DIR is required")
    assert_clean_error(aieng("frobnicate"), "invalid choice", code=2)


def test_eval_prints_tokens_and_perplexity(tmp_path):
    text = tmp_path / "psalm.txt"
    text.write_text(
        "The LORD is my shepherd; I shall not want.\n"
        "He maketh me to lie down in green pastures: he leadeth me beside the still waters.\n"
    )
    done = aieng("eval", str(text), "--json", "--window", "16", "--stride", "8")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["window"] == 16 and result["stride"] == 8
    assert result["tokens"] == result["text_tokens"] - 1
    assert 1 < result["perplexity"] < 4096
    human = aieng("eval", str(text))
    assert human.returncode == 0 and "perplexity" in human.stdout and "tokens" in human.stdout


def test_chat_reads_turns_from_stdin():
    done = aieng(
        "chat", "--max-tokens", "8", "--temperature", "0", stdin="Who made the heaven?\n/exit\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_train_then_resume(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", 60, seed=3)
    out = tmp_path / "model"
    size = ["--vocab-size", "300", "--hidden-size", "32", "--num-layers", "1", "--num-heads",
            "2", "--num-kv-heads", "2", "--intermediate-size", "64", "--seq-len", "32",
            "--batch-size", "4", "--threads", "1", "--log-interval", "1"]  # fmt: skip
    done = aieng("train", "--data", str(corpus), "--out", str(out), "--steps", "3", *size)
    assert done.returncode == 0, done.stderr
    assert "trained" in done.stdout and "3/3" in done.stderr
    again = aieng("train", "--resume", str(out), "--steps", "5")
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stderr and "5/5" in again.stderr
    generated = aieng("generate", "The king", "--model", str(out), "--max-tokens", "4")
    assert generated.returncode == 0, generated.stderr


def test_bench_prints_table_and_plots(tmp_path):
    png, result = tmp_path / "bench.png", tmp_path / "bench.json"
    done = aieng(
        "bench", "--requests", "4", "--max-len", "24", "--plot", str(png), "--json", str(result)
    )
    assert done.returncode == 0, done.stderr
    assert "| aieng |" in done.stdout and "| HF transformers |" in done.stdout
    summary = json.loads(result.read_text())
    assert summary["greedy_identical_requests"] == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
