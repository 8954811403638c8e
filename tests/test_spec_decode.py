"""Speculative decoding (ngram prompt lookup, and proposers written here): the output is token
for token plain decoding's — greedy on two model families with chunked prefill, prefix hits and
preemption; seeded sampling with temperature, top-p and penalties; stop ids, max_tokens,
min_tokens, logprobs, n > 1 and streaming inside accepted runs; a proposer that is always wrong;
grammar requests — and the block pool ends whole. Bad configurations are refused by name."""

import argparse
import json

import httpx
import jsonschema
import numpy as np
import pytest
from server_fixtures import MODEL_NAME, ThreadServer
from text_fixtures import byte_level_bpe, save_model_dir
from tiny_models import build_checkpoint

from aieng import LLM, SamplingParams, StructuredOutputsParams
from aieng.config.engine_args import EngineArgs
from aieng.config.speculative import SpeculativeConfig
from aieng.spec_decode.drafts import SpeculativeDecoding
from aieng.spec_decode.ngram import NgramProposer
from aieng.spec_decode.proposer import ProposalRequest

VOCAB = 384
# Speculating at every batch size (the CPU's measured default stops above one request).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "disable_by_batch_size": 0}  # fmt: skip
PROMPTS = [
    "the cat sat on the mat and the cat sat on the mat and the",
    "one two three one two three one two",
    "In the beginning God created the heaven and the earth.",
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
]


def make_model(folder, arch: str):
    save_model_dir(folder, byte_level_bpe(VOCAB))
    build_checkpoint(arch, folder, vocab_size=VOCAB)
    return folder


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    return make_model(tmp_path_factory.mktemp(request.param), request.param)


def tokens_of(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def engine(folder, speculative=None, **options) -> LLM:
    options.setdefault("kv_cache_memory", 1 << 22)
    return LLM(str(folder), block_size=4, speculative_config=speculative, **options)


class OracleProposer:
    """Proposes the continuation plain decoding gave (every draft right), or with `wrong`
    a token that is never it (every draft rejected)."""

    def __init__(self, plain: dict[tuple[int, ...], list[int]], k: int, wrong: bool = False):
        self.plain, self.k, self.wrong = plain, k, wrong

    def propose(self, requests):
        drafts = []
        for r in requests:
            tokens = r.token_ids.tolist()
            draft = []
            for prompt, output in self.plain.items():
                n = len(prompt)
                if tokens[:n] == list(prompt) and tokens[n:] == output[: len(tokens) - n]:
                    draft = output[len(tokens) - n :][: min(self.k, r.max_tokens)]
            if self.wrong:
                draft = [(t + 1) % VOCAB for t in draft] or [0] * min(self.k, r.max_tokens)
            drafts.append(draft)
        return drafts


def assert_logprobs_close(ours, theirs) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() == b.keys() and list(a.values()) == pytest.approx(
            list(b.values()), abs=1e-4
        )


def with_proposer(llm: LLM, proposer) -> LLM:
    llm.engine.speculation.proposer = proposer
    return llm


# ------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "'method' 'medusa' is unknown"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "'num_speculative_tokens' must be"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "'num_speculative_tokens' must be"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 1}, "unknown field 'lookup'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "lookup_min"),
        ({"method": "ngram", "model": "d", "num_speculative_tokens": 2}, "a draft model's"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "must be an integer"),
        ("ngram", "must be a JSON object"),
    ],
)
def test_bad_configs_are_refused_by_name(config, match):
    with pytest.raises(ValueError, match="speculative_config") as error:
        EngineArgs(speculative_config=config)
    assert match in str(error.value)


def test_unset_batch_limit_is_the_measured_one_for_the_device(llama):
    """Without disable_by_batch_size, a CPU engine speculates for up to 8 running requests and
    not for more (benches/results/bench_speculative_sweep.md); 0 speculates at any batch."""
    from aieng.config.speculative import measured_batch_limit

    unset = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert measured_batch_limit(unset, "cpu") == 8
    assert measured_batch_limit(unset, "cuda:0") == 0  # not measured: no limit
    assert measured_batch_limit(SpeculativeConfig.from_dict(NGRAM), "cpu") == 0
    config = {k: v for k, v in NGRAM.items() if k != "disable_by_batch_size"}
    llm = engine(llama, config)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    many = [PROMPTS[i % 3] + " " * (i // 3) for i in range(9)]
    llm.generate(many, greedy, use_tqdm=False)  # nine running: no drafts
    assert llm.get_stats().spec_decode_num_drafts == 0
    llm.generate(PROMPTS[:2], greedy, use_tqdm=False)  # two: drafts
    assert llm.get_stats().spec_decode_num_drafts > 0


def test_the_flag_takes_json_and_refuses_bad_json():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, only=["speculative_config"])
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert EngineArgs.from_cli_args(args).speculative_config == NGRAM
    assert SpeculativeConfig.from_dict(NGRAM).prompt_lookup_max == 3
    for bad in ("{not json", '{"method": "ngram", "num_speculative_tokens": 99}'):
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-config", bad])


def test_ngram_proposes_after_the_longest_latest_match():
    proposer = NgramProposer(3, lookup_min=1, lookup_max=3)
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3])
    # "2 3" then "3": the longest suffix found earlier is "2 3", latest at index 5 -> 4 5 7.
    assert proposer.propose_one(tokens, 3) == [4, 5, 7]
    assert proposer.propose_one(np.array([1, 2, 1]), 3) == [2, 1]
    assert proposer.propose_one(np.array([1, 2, 3]), 3) == []
    assert NgramProposer(3, 2, 3).propose_one(np.array([4, 1, 4, 2, 4]), 3) == []


# ------------------------------------------------------------------ exactness


def test_greedy_is_plain_decoding_with_chunks_prefix_hits_and_preemption(model):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    plain = engine(model).generate(PROMPTS, greedy, use_tqdm=False)
    # 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 2 bytes (bfloat16: the CPU's default cache)
    # x 4 tokens = 1 KiB a block.
    for options in ({}, {"long_prefill_token_threshold": 3}, {"kv_cache_memory": 20 * 1024}):
        llm = engine(model, NGRAM, **options)
        for _ in range(1 if options else 2):  # the second time the prompts are cache hits
            spec = llm.generate(PROMPTS, greedy, use_tqdm=False)
            assert tokens_of(spec) == tokens_of(plain), options
            for a, b in zip(plain, spec, strict=True):
                assert b.outputs[0].text == a.outputs[0].text
                assert_logprobs_close(b.outputs[0].logprobs, a.outputs[0].logprobs)
        stats = llm.get_stats()
        assert stats.spec_decode_num_accepted_tokens > 0, options
        assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_accepted_tokens
        if "kv_cache_memory" in options:
            assert stats.num_preemptions > 0
        elif not options:
            assert stats.prefix_cache_hits > 0
        llm.engine.check_pool_whole()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llama_sampled"), "llama")


def plain_continuations(outputs) -> dict[tuple[int, ...], list[int]]:
    return {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outputs}


SAMPLED = [
    SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.4, seed=5,
                   max_tokens=20, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.7, top_k=20, min_p=0.05, presence_penalty=0.5, seed=9,
                   max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=17, stop_token_ids=[], ignore_eos=True),
]  # fmt: skip


@pytest.mark.parametrize("wrong", [False, True])
def test_seeded_sampling_is_plain_decoding_token_for_token(llama, wrong):
    """Each emitted token takes one draw keyed by (seed, output index): speculation, whether
    its drafts are all accepted or all rejected, changes no token."""
    plain = engine(llama).generate(PROMPTS, SAMPLED, use_tqdm=False)
    llm = with_proposer(
        engine(llama, NGRAM), OracleProposer(plain_continuations(plain), 4, wrong=wrong)
    )
    spec = llm.generate(PROMPTS, SAMPLED, use_tqdm=False)
    assert tokens_of(spec) == tokens_of(plain)
    assert_logprobs_close(spec[1].outputs[0].logprobs, plain[1].outputs[0].logprobs)
    stats = llm.get_stats()
    if wrong:
        assert stats.spec_decode_num_accepted_tokens == 0 < stats.spec_decode_num_draft_tokens
    else:  # a right proposer: most steps take k + 1 tokens
        assert stats.spec_decode_num_accepted_tokens > 0.8 * stats.spec_decode_num_draft_tokens
        assert (
            stats.spec_decode_accepted_per_position[0] >= stats.spec_decode_accepted_per_position[3]
        )
    llm.engine.check_pool_whole()


def test_stops_lengths_min_tokens_n_and_streams_inside_accepted_runs(llama):
    prompt = PROMPTS[0]
    probe = engine(llama).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )
    out = probe[0].outputs[0].token_ids
    stop_id = out[9]
    text = probe[0].outputs[0].text
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop=[text[12:16]]),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=12, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.9, n=3, seed=11, max_tokens=15, ignore_eos=True),
    ]  # fmt: skip
    prompts = [prompt] * len(params)
    plain = engine(llama).generate(prompts, params, use_tqdm=False)
    continuations = {tuple(probe[0].prompt_token_ids): out}
    llm = with_proposer(engine(llama, NGRAM), OracleProposer(continuations, 5))
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (y.token_ids, y.text, y.finish_reason, y.stop_reason) == (
                x.token_ids,
                x.text,
                x.finish_reason,
                x.stop_reason,
            )
    assert (
        spec[0].outputs[0].token_ids[-1] == stop_id and spec[1].outputs[0].finish_reason == "length"
    )
    assert len(spec[3].outputs[0].token_ids) > 12
    streamed = list(llm.stream(prompt, params[1]))
    deltas = [d.outputs[0].token_ids for d in streamed]
    assert [t for d in deltas for t in d] == plain[1].outputs[0].token_ids
    assert max(len(d) for d in deltas) > 1, "an accepted run arrives in one delta"
    llm.engine.check_pool_whole()


def test_grammar_requests_stay_valid_beside_speculating_ones(llama):
    schema = {"enum": ["Moses", "Aaron", 7]}
    constrained = SamplingParams(
        temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=schema)
    )
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = engine(llama).generate(PROMPTS[:2], [constrained, free], use_tqdm=False)
    llm = engine(llama, NGRAM)
    spec = llm.generate(PROMPTS[:2], [constrained, free], use_tqdm=False)
    assert tokens_of(spec) == tokens_of(plain)
    assert spec[0].outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(spec[0].outputs[0].text), schema)
    assert llm.get_stats().spec_decode_num_accepted_tokens > 0
    llm.engine.check_pool_whole()


@pytest.mark.parametrize("wrong", [False, True])
def test_grammar_requests_speculate_within_their_grammar(llama, wrong):
    """A grammar request verifies drafts too: right ones (the plain continuation) are taken
    under the masks that follow them, wrong ones are cut by the core where the grammar forbids
    (or rejected); the output is plain decoding's, valid against the schema, either way."""
    schema = {"type": "object", "properties": {"name": {"enum": ["Moses", "Aaron"]}},
              "required": ["name"], "additionalProperties": False}  # fmt: skip
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)
    )
    plain = engine(llama).generate([PROMPTS[0]], params, use_tqdm=False)
    prompt = tuple(engine(llama).engine.tokenizer.encode(PROMPTS[0]))
    proposer = OracleProposer({prompt: plain[0].outputs[0].token_ids}, 4, wrong=wrong)
    llm = with_proposer(engine(llama, NGRAM), proposer)
    spec = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert tokens_of(spec) == tokens_of(plain)
    jsonschema.validate(json.loads(spec[0].outputs[0].text), schema)
    stats = llm.get_stats()
    if wrong:
        assert stats.spec_decode_num_accepted_tokens == 0
    else:
        assert stats.spec_decode_num_accepted_tokens > 5, "the right drafts were verified"
    llm.engine.check_pool_whole()


def test_the_server_streams_speculated_tokens_and_exports_the_counts(llama):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0}
    with ThreadServer(llama, engine={"speculative_config": NGRAM}) as server:
        plain = engine(llama).generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24))
        served = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert served["choices"][0]["text"] == plain[0].outputs[0].text
        metrics = server.wait_idle()
    drafted = metrics["aieng_spec_decode_num_draft_tokens_total"]
    accepted = metrics["aieng_spec_decode_num_accepted_tokens_total"]
    assert drafted >= accepted > 0 and metrics["aieng_spec_decode_num_drafts_total"] > 0
    assert metrics["aieng_spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0
    assert metrics["aieng_spec_decode_num_accepted_tokens_per_pos_total"] == accepted


def test_abort_in_a_speculating_stream_leaves_the_pool_whole(llama):
    llm = with_proposer(engine(llama, NGRAM), OracleProposer({}, 4, wrong=True))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    stream = llm.stream(PROMPTS[1], params)
    first = next(stream)
    assert first.prompt_logprobs is not None and first.outputs[0].token_ids
    for _ in range(3):
        next(stream)
    stream.close()  # aborts the request between steps, drafts and all
    assert llm.get_stats().spec_decode_num_draft_tokens > 0
    llm.engine.check_pool_whole()


def test_a_request_whose_drafts_fail_proposes_only_to_probe():
    spec = SpeculativeDecoding(SpeculativeConfig.from_dict(NGRAM))
    spec.proposer = OracleProposer({}, 4, wrong=True)
    requests = [ProposalRequest("bad", np.array([1, 2]), 10)]
    proposed = []
    for _ in range(20):
        [draft] = spec.propose(requests)
        proposed.append(bool(draft))
        if draft:  # one verification: every draft rejected, one token taken
            spec.record(np.zeros(1 + len(draft), np.int32), np.array([1]), ["bad"])
    # 4 drafts a step: judged poor after 16 draft tokens, then one probe every 8 steps.
    assert proposed[:4] == [True] * 4 and proposed[4:12] == [False] * 7 + [True]
    assert spec.num_drafts == sum(proposed) and spec.num_accepted_tokens == 0


def test_no_drafts_in_a_batch_above_disable_by_batch_size(llama):
    config = {**NGRAM, "disable_by_batch_size": 1}
    assert SpeculativeDecoding(SpeculativeConfig.from_dict(config)).wanted(1)
    llm = with_proposer(engine(llama, config), OracleProposer({}, 4, wrong=True))
    two = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 12)]
    llm.generate(PROMPTS[:2], two, use_tqdm=False)
    # Drafts only once the shorter request ended: steps 7..12 of the longer one, alone.
    assert 0 < llm.get_stats().spec_decode_num_drafts <= 6
    llm.generate(PROMPTS[:1], two[0], use_tqdm=False)
    assert llm.get_stats().spec_decode_num_drafts > 6
    llm.engine.check_pool_whole()
