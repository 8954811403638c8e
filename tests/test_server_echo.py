"""`/v1/completions` with echo, logprobs and max_tokens 0: the prompt's own logprobs, the way
OpenAI's legacy API returned them — replaying lm-evaluation-harness's loglikelihood and rolling
requests, held against transformers and against `aieng eval`."""

import math

import httpx
import openai
import pytest
import torch
from server_fixtures import MODEL_NAME, ThreadServer, make_model_dir
from tiny_models import load_hf

from aieng._core import Tokenizer
from aieng.benchmarks.evaluate import perplexity, sliding_windows

TEXT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, "
    "and void; and darkness was upon the face of the deep.\n"
) * 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("echo"), max_positions=256)


@pytest.fixture(scope="module")
def server(model):
    # A float32 cache: the logprobs are held to transformers' (auto is bfloat16 on the CPU).
    engine = {"max_num_batched_tokens": 48, "max_num_seqs": 8, "kv_cache_dtype": "float32"}
    with ThreadServer(model, engine=engine) as running:
        yield running
        running.wait_idle()
        running.in_engine(lambda engine: engine.check_pool_whole())


@pytest.fixture(scope="module")
def hf(model):
    return load_hf(model)


def hf_token_logprobs(hf, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def complete(server, **body) -> dict:
    response = httpx.post(
        f"{server.url}/v1/completions", json={"model": MODEL_NAME, **body}, timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()


def lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-evaluation-harness's local-completions parse_logprobs, written out."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    greedy = all(
        lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs, strict=True)
    )
    return sum(token_logprobs), greedy


def test_lm_eval_loglikelihood_requests(server, hf):
    """lm-eval's exact body: token-id prompts (context + continuation), max_tokens 1, echo."""
    generator = torch.Generator().manual_seed(0)
    contexts = [torch.randint(3, 384, (n,), generator=generator).tolist() for n in (5, 30, 61)]
    continuations = [torch.randint(3, 384, (n,), generator=generator).tolist() for n in (1, 4, 9)]
    prompts = [c + x for c, x in zip(contexts, continuations, strict=True)]
    body = {"prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234}
    out = complete(server, echo=True, **body)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == 3
    for choice, prompt, context in zip(choices, prompts, contexts, strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + 1  # the prompt, then the one token
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected = hf_token_logprobs(hf, prompt)
        assert logprobs["token_logprobs"][1 : len(prompt)] == pytest.approx(expected, abs=1e-4)
        total, greedy = lm_eval_parse(choice, len(context))
        assert total == pytest.approx(sum(expected[len(context) - 1 :]), abs=1e-3)
        with torch.no_grad():
            argmax = hf(torch.tensor([prompt])).logits[0, :-1].argmax(-1).tolist()
        assert greedy == (argmax[len(context) - 1 :] == prompt[len(context) :])
        offsets = logprobs["text_offset"]
        assert offsets == sorted(offsets) and offsets[0] == 0
    assert out["usage"]["completion_tokens"] == 3


def test_max_tokens_zero_returns_the_prompt_only(server, hf):
    prompt = "And God said, Let there be light"
    out = complete(server, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    (choice,) = out["choices"]
    assert choice["text"] == prompt
    assert choice["finish_reason"] == "length"
    ids = Tokenizer.from_dir(str(server.ctx.config.model_path)).encode(prompt, True)
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(ids)
    assert logprobs["token_logprobs"][1:] == pytest.approx(hf_token_logprobs(hf, ids), abs=1e-4)
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"][1:])
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize(("window", "stride"), [(64, 32), (100, 100)])
def test_rolling_perplexity_through_the_server_equals_aieng_eval(
    server, model, tmp_path, window, stride
):
    """loglikelihood_rolling: each window scored by an echo request, the previous window's
    tokens skipped — the same windows as `aieng eval`."""
    ids = Tokenizer.from_dir(str(model)).encode(TEXT, True)
    total, count = 0.0, 0
    for begin, end, first in sliding_windows(len(ids), window, stride):
        out = complete(
            server, prompt=ids[begin:end], echo=True, logprobs=0, max_tokens=0, temperature=0
        )
        scored = out["choices"][0]["logprobs"]["token_logprobs"][first - begin :]
        total -= sum(scored)
        count += len(scored)
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    expected = perplexity(model, text_file, window=window, stride=stride, kv_cache_dtype="float32")
    assert count == expected.tokens
    assert math.exp(total / count) == pytest.approx(expected.perplexity, rel=1e-3)


def test_streamed_echo_matches_the_whole_response(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    prompt = "the earth was without form"
    args = dict(model=MODEL_NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=5, temperature=0)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, **args))
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == whole.choices[0].text
    assert whole.choices[0].text.startswith(prompt)
    assert streamed[0].text.startswith(prompt)
    tokens = [t for c in streamed if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in streamed if c.logprobs for o in c.logprobs.text_offset]
    assert tokens == whole.choices[0].logprobs.tokens
    assert offsets == whole.choices[0].logprobs.text_offset
    assert whole.choices[0].logprobs.token_logprobs[0] is None
    assert len(whole.choices[0].logprobs.tokens) == whole.usage.prompt_tokens + 5


def test_echo_without_logprobs_and_with_n(server):
    out = complete(server, prompt="Let there be", echo=True, max_tokens=3, n=2, seed=3)
    assert [c["text"][: len("Let there be")] for c in out["choices"]] == ["Let there be"] * 2
    assert all(c["logprobs"] is None for c in out["choices"])


def test_bad_max_tokens_is_a_400(server):
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "a", "max_tokens": -1},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
