"""The official `openai` client against a real server on loopback: completions and chat,
streaming and not, n > 1, stop, seed, logprobs, usage; the routes beside them."""

import httpx
import openai
import pytest
from server_fixtures import MODEL_NAME, ThreadServer, make_model_dir

PROMPTS = ["The quick brown fox", "In the beginning was the word", "Paged attention keeps"]
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ThreadServer(make_model_dir(tmp_path_factory.mktemp("model"))) as s:
        yield s
        s.wait_idle()
        s.in_engine(lambda engine: engine.check_pool_whole())


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_completion_joins_to_the_whole_one(client, prompt):
    whole = client.completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY)
    [choice] = whole.choices
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_and_not(client):
    messages = [{"role": "user", "content": "The quick brown fox"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, stream=True, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(_chat_ids(client, messages))


def _chat_ids(client, messages):
    response = httpx.post(
        str(client.base_url).replace("/v1/", "/tokenize"), json={"messages": messages}
    )
    return response.json()["tokens"]


def test_n_completions_share_the_prompt_blocks_and_each_stream_ends(server, client):
    prompt = "Stop strings end a request: STOP here, or END there. " * 2
    before = server.metrics()["aieng_prefix_cache_hits_total"]
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        n=3,
        temperature=1.0,
        seed=11,
        max_tokens=6,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts, finishes = ["", "", ""], [None, None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            assert finishes[c.index] is None, "a choice continued after its finish_reason"
            finishes[c.index] = c.finish_reason
    assert finishes == ["length"] * 3
    prompt_len = server.in_loop(lambda: len(server.ctx.engine.tokenizer.encode(prompt)))
    full_blocks = (prompt_len - 1) // 4 * 4  # block size 4; the last token is always computed
    hits = server.metrics()["aieng_prefix_cache_hits_total"] - before
    assert hits >= 2 * full_blocks  # both siblings found the first one's prompt blocks
    again = client.completions.create(
        model=MODEL_NAME, prompt=prompt, n=3, temperature=1.0, seed=11, max_tokens=6,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in again.choices] == texts  # a seed fixes every choice
    assert len(set(texts)) > 1


def test_batched_prompts_and_stop(client):
    free = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, **GREEDY)
    assert [c.index for c in free.choices] == [0, 1, 2]
    text = free.choices[1].text
    at = next(i for i in range(1, len(text) - 3) if text.find(text[i : i + 3]) == i)
    stop = text[at : at + 3]
    cut = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], stop=[stop], **GREEDY)
    assert cut.choices[0].text == text[:at]
    assert cut.choices[0].finish_reason == "stop"
    tokens = client.completions.create(
        model=MODEL_NAME, prompt=[[5, 6, 7, 8]], temperature=0, max_tokens=3
    )
    assert tokens.usage.prompt_tokens == 4


def test_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        # keyed by token text, so two tokens that both decode to U+FFFD share a key
        assert 1 <= len(top) <= 3 and chosen == pytest.approx(max(top.values()))  # greedy
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 12 and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)


def test_models_tokenize_detokenize_and_request_ids(server, client):
    [model] = client.models.list().data
    assert model.id == MODEL_NAME
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The quick brown fox"}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 2048
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": ids["tokens"]}).json()
    assert back["prompt"].endswith("The quick brown fox")
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "The", "max_tokens": 2},
        headers={"X-Request-Id": "trace-42"},
    )
    assert response.headers["x-request-id"] == "trace-42"
    assert response.json()["id"] == "cmpl-trace-42"
    made = httpx.get(f"{server.url}/health").headers["x-request-id"]
    assert len(made) == 32


def test_metrics_count_what_was_served(server, client):
    before = server.metrics()
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], **GREEDY)
    after = server.wait_idle()
    assert after["aieng_generation_tokens_total"] - before["aieng_generation_tokens_total"] == 12
    assert (
        after["aieng_request_success_total{finished_reason=length}"]
        - before.get("aieng_request_success_total{finished_reason=length}", 0)
        == 1
    )
    for name in (
        "aieng_time_to_first_token_seconds_count",
        "aieng_inter_token_latency_seconds_count",
        "aieng_e2e_request_latency_seconds_count",
        "aieng_request_queue_time_seconds_count",
        "aieng_request_time_per_output_token_seconds_count",
        "aieng_iteration_tokens_total_count",
    ):
        assert after[name] > before[name], name
    assert after["aieng_prompt_tokens_total"] > before["aieng_prompt_tokens_total"]
    assert after["aieng_kv_cache_usage_perc"] == 0.0
    assert after["aieng_prefix_cache_queries_total"] >= after["aieng_prefix_cache_hits_total"]
    assert "aieng_num_preemptions_total" in after


def test_penalties_change_a_repetitive_greedy_text(client):
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], **GREEDY)
    text = plain.choices[0].text
    penalised = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], frequency_penalty=2.0, presence_penalty=1.0, **GREEDY
    )
    assert penalised.choices[0].text != text


def test_a_repeated_prompt_reports_its_cached_tokens(client):
    prompt = "Numbers 3.14159 2.71828 1,000,000 and symbols, all of them cached"
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < cached < again.usage.prompt_tokens and cached % 4 == 0
