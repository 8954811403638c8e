"""LLM end to end against Hugging Face transformers on tiny random checkpoints.

Greedy tokens must be identical to HF `generate` and chosen-token logprobs within 1e-4,
also with chunked prefill, preemption, prefix-cache hits and mixed sampling in one batch (on a
float32 cache: `auto` is bfloat16 under the native CPU decoder, held close in test_cpu_native.py).
After every test the KV pool is whole.
"""

import json
import shutil

import pytest
from text_fixtures import PROMPTS, byte_level_bpe, save_model_dir
from tiny_models import ARCHITECTURES, build_checkpoint, hf_greedy, load_hf

import aieng
from aieng import LLM, SamplingParams

VOCAB = 384
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def make_model(folder, arch="llama"):
    save_model_dir(folder, byte_level_bpe(VOCAB))
    return build_checkpoint(arch, folder, vocab_size=VOCAB)


class HFReference:
    def __init__(self, folder):
        self.hf = load_hf(folder)
        self.cache: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def greedy(self, prompt_ids, n=MAX_TOKENS):
        key = (*prompt_ids, -n)
        if key not in self.cache:
            self.cache[key] = hf_greedy(self.hf, list(prompt_ids), n)
        return self.cache[key]


def assert_matches_hf(ref, outputs, check_logprobs=True):
    for out in outputs:
        tokens, logprobs = ref.greedy(out.prompt_token_ids, len(out.outputs[0].token_ids))
        completion = out.outputs[0]
        assert completion.token_ids == tokens, out.prompt
        if check_logprobs:
            ours = [lp[t] for lp, t in zip(completion.logprobs, tokens, strict=True)]
            assert ours == pytest.approx(logprobs, abs=1e-4)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = make_model(tmp_path_factory.mktemp("llama"))
    return folder, HFReference(folder)


@pytest.fixture(scope="module")
def llm(llama):
    engine = LLM(str(llama[0]), kv_cache_memory=1 << 22, block_size=4, kv_cache_dtype="float32")
    yield engine
    engine.engine.check_pool_whole()


@pytest.fixture(autouse=True)
def pool_is_whole_after(request):
    yield
    if "llm" in request.fixturenames:
        request.getfixturevalue("llm").engine.check_pool_whole()


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_batch_matches_hf(arch, tmp_path):
    folder = make_model(tmp_path, arch)
    llm = LLM(str(folder), kv_cache_memory=1 << 22, block_size=4, kv_cache_dtype="float32")
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    assert_matches_hf(HFReference(folder), outputs)
    llm.engine.check_pool_whole()


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_chunked_prefill_gives_the_same_tokens(llama, chunk):
    folder, ref = llama
    llm = LLM(
        str(folder),
        kv_cache_memory=1 << 22,
        block_size=4,
        kv_cache_dtype="float32",
        long_prefill_token_threshold=chunk,
    )
    assert_matches_hf(ref, llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.engine.check_pool_whole()


def test_preemption_gives_the_same_tokens(llama):
    folder, ref = llama
    # 2 layers x 2 kv heads x 16 dims x 2 (K, V) x 4 bytes x 4 tokens = 2 KiB per block.
    llm = LLM(str(folder), kv_cache_memory=28 * 2048, block_size=4, kv_cache_dtype="float32")
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.core.stats()["num_preemptions"] > 0
    assert_matches_hf(ref, outputs)
    llm.engine.check_pool_whole()


def test_prefix_cache_hits_give_the_same_tokens(llm, llama):
    _, ref = llama
    tok = llm.get_tokenizer()
    shared = tok.encode(PROMPTS[7])[:16]  # a multiple of the block size
    prompts = [shared, [*shared, 5, 6, 7], [*shared[:9], 11, 12]]
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [12, 16, 8]
    for a, b in zip(first, again, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_matches_hf(ref, again)


def test_mixed_sampling_params_in_one_batch(llm, llama):
    _, ref = llama
    sampled = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=MAX_TOKENS, seed=3)
    penalised = SamplingParams(temperature=0.7, repetition_penalty=1.3, max_tokens=MAX_TOKENS)
    params = [GREEDY if i % 3 == 0 else sampled if i % 3 == 1 else penalised for i in range(8)]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_matches_hf(ref, outputs[::3])
    assert all(len(o.outputs[0].token_ids) <= MAX_TOKENS for o in outputs)


def test_seeded_sampling_is_reproducible_across_batches(llm):
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0]
    others = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    batch = [others, params, others, others]
    crowded = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[6]], batch, use_tqdm=False)
    assert crowded[1].outputs[0].token_ids == alone.outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    differ = {tuple(llm.generate([PROMPTS[3]], unseeded)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(differ) > 1


def test_stop_strings_cut_the_text(llm):
    free = llm.generate(["The quick"], GREEDY, use_tqdm=False)[0].outputs[0]
    text = free.text
    stop = text[3:6]
    assert len(stop) == 3 and text.find(stop) == 3
    cut = llm.generate(
        ["The quick"], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop])
    )[0].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (text[:3], "stop", stop)
    kept = llm.generate(
        ["The quick"],
        SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, stop=stop, include_stop_str_in_output=True
        ),
    )[0].outputs[0]
    assert kept.text == text[:6]


def test_stop_token_ids_and_eos_lists(llm, llama, tmp_path):
    free = llm.generate(["The quick"], GREEDY, use_tqdm=False)[0].outputs[0]
    target = free.token_ids[4]
    first = free.token_ids.index(target)
    out = llm.generate(
        ["The quick"],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[target]),
    )[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", target)
    # An EOS list in generation_config.json: any of its ids ends the request.
    folder = tmp_path / "eos-list"
    shutil.copytree(llama[0], folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, target]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    eos_llm = LLM(str(folder), kv_cache_memory=1 << 22, block_size=4, kv_cache_dtype="float32")
    out = eos_llm.generate(["The quick"], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert out[0].outputs[0].token_ids == free.token_ids[: first + 1]
    assert out[0].outputs[0].stop_reason == target
    eos_llm.engine.check_pool_whole()


def test_stream_deltas_join_to_the_final_text(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [whole] = llm.generate([PROMPTS[5]], params, use_tqdm=False)
    deltas = list(llm.stream(PROMPTS[5], params))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.outputs[0].text for d in deltas) == whole.outputs[0].text
    streamed = [t for d in deltas for t in d.outputs[0].token_ids]
    assert streamed == whole.outputs[0].token_ids
    assert deltas[-1].outputs[0].finish_reason == "length"
    # Breaking out of a stream aborts the request and frees its blocks.
    for _ in llm.stream(PROMPTS[5], params):
        break


def test_n_completions_and_metrics(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=7, ignore_eos=True)
    [out] = llm.generate(["The"], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    m = out.metrics
    assert m.time_to_first_token is not None and m.time_to_first_token >= m.queue_time >= 0
    assert m.time_per_output_token is not None


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "The quick brown fox"}]
    [out] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    tok = llm.get_tokenizer()
    expected = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
    )
    assert out.prompt_token_ids == expected


@pytest.mark.parametrize(
    ("prompt", "params", "error", "match"),
    [
        ("", GREEDY, ValueError, "empty"),
        ("The " * 300, GREEDY, aieng.RequestTooLargeError, "max_model_len"),
        ([1, 2, VOCAB + 5], GREEDY, aieng.InvalidArgumentError, "outside the vocabulary"),
    ],
)
def test_bad_input_is_refused_and_the_engine_keeps_serving(llm, prompt, params, error, match):
    with pytest.raises(error, match=match):
        llm.generate([PROMPTS[1], prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    [ok] = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == MAX_TOKENS


def test_invalid_sampling_params_and_missing_models():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        LLM("/nonexistent/model")


def test_min_tokens_is_decided_by_the_core_and_banned_in_the_sampler(llm):
    """EOS (or a stop id) made the likeliest token by logit_bias is not drawn before min_tokens
    outputs (the core lists the bans in the plan; the sampler applies them), and ends the
    request as soon as it may; with ignore_eos, EOS is not banned and does not end it."""
    eos = llm.engine.eos_token_ids[0]
    prompt = [[5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logit_bias={eos: 100})
    [out] = llm.generate(prompt, params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert eos not in tokens[:3] and tokens[3:] == [eos], tokens
    assert out.outputs[0].finish_reason == "stop"
    stop = SamplingParams(
        temperature=0, max_tokens=8, min_tokens=2, stop_token_ids=[9], logit_bias={9: 100}
    )
    [out] = llm.generate(prompt, stop, use_tqdm=False)
    assert out.outputs[0].token_ids[2:] == [9] and 9 not in out.outputs[0].token_ids[:2]
    assert out.outputs[0].stop_reason == 9
    free = SamplingParams(
        temperature=0, max_tokens=4, min_tokens=2, ignore_eos=True, logit_bias={eos: 100}
    )
    [out] = llm.generate(prompt, free, use_tqdm=False)
    assert out.outputs[0].token_ids == [eos] * 4 and out.outputs[0].finish_reason == "length"


def test_prompts_in_vllm_dict_form(llm):
    """{"prompt": text} and {"prompt_token_ids": ids}, as vLLM takes them, give what the text and
    the ids give; any other dict, or a prompt of another type, is refused by name."""
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    want = llm.generate([PROMPTS[1], ids], GREEDY, use_tqdm=False)
    got = llm.generate([{"prompt": PROMPTS[1]}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    [single] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert single.outputs[0].token_ids == want[1].outputs[0].token_ids
    streamed = [
        t for out in llm.stream({"prompt": PROMPTS[1]}, GREEDY) for t in out.outputs[0].token_ids
    ]
    assert streamed == want[0].outputs[0].token_ids
    with pytest.raises(aieng.InvalidArgumentError, match=r"keys \['multi_modal_data', 'prompt'\]"):
        llm.generate([{"prompt": "x", "multi_modal_data": {}}], GREEDY, use_tqdm=False)
    with pytest.raises(aieng.InvalidArgumentError, match=r"got float: 1\.5"):
        llm.generate([PROMPTS[1], 1.5], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
