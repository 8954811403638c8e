"""Several accepted tokens per sampled row (what speculative decoding will return), from the
runner's output on: the engine hands them to the core, every token reaches the output in order,
every stop check applies to each of them, and the tokens after the first are computed as the
request's next query tokens.

The runner producing them (speculative decoding's verification) is tested in
tests/test_spec_decode.py; the engine tests below add extra tokens to the runner's output,
above it — the runner's sampling table never sees them there. How the sampling table takes
several tokens of one row is tested on the table itself (the last test), against a request
resumed with the same outputs."""

import numpy as np
import pytest
import torch
from text_fixtures import byte_level_bpe, save_model_dir
from tiny_models import build_checkpoint

from aieng import LLM, SamplingParams
from aieng.worker.runner_io import ModelRunnerOutput
from aieng.worker.sampler import Sampler, SamplingTable

VOCAB = 384


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multi")
    save_model_dir(folder, byte_level_bpe(VOCAB))
    build_checkpoint("llama", folder, vocab_size=VOCAB)
    return LLM(str(folder), max_num_seqs=4, kv_cache_memory=1 << 22, block_size=4)


def with_extra_tokens(llm, monkeypatch, extra: list[int]):
    """Each row's sampled token is followed by the tokens `extra`, as if they were accepted:
    added to what `runner.execute` returns, after the runner recorded its one token per row."""
    runner = llm.engine.runner
    execute = runner.execute
    plans = []

    def execute_more(step):
        plans.append(step.plan)
        out = execute(step)
        rows = len(out.num_sampled)
        tokens = np.concatenate([[t, *extra] for t in out.sampled_token_ids]).astype(np.int64)
        counts = np.full(rows, 1 + len(extra), np.int32)
        return ModelRunnerOutput(tokens, counts, out.logprobs)

    monkeypatch.setattr(runner, "execute", execute_more)
    return plans


def test_injected_tokens_are_output_and_computed_next(llm, monkeypatch):
    plans = with_extra_tokens(llm, monkeypatch, [7, 8])
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    [out] = llm.generate([[5, 6, 9, 10, 11]], params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 9 and tokens[1:3] == [7, 8] and tokens[4:6] == [7, 8]
    # After the first step each step runs the three tokens the last one accepted.
    assert [len(p.input_ids) for p in plans] == [5, 3, 3]
    assert plans[1].input_ids.tolist() == tokens[:3]
    llm.engine.check_pool_whole()


def test_a_stop_inside_an_injected_row_drops_the_rest(llm, monkeypatch):
    with_extra_tokens(llm, monkeypatch, [7, 8, 9])
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[8])
    [out] = llm.generate([[5, 6, 9, 10, 11]], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids[-2:] == [7, 8] and completion.finish_reason == "stop"
    assert completion.stop_reason == 8
    llm.engine.check_pool_whole()


def test_the_sampling_table_takes_a_rows_tokens_at_once():
    """A slot repeated in one `append_tokens` call (what a runner accepting several tokens per
    row will hand its table) leaves the state of one token per step, and of a request resumed
    with those outputs: output counts (penalties), the output index (seeded draws) and the
    bad-words history. (min_tokens is the core's: its bans come with the plan.)"""
    params = SamplingParams(
        temperature=1.0, seed=7, repetition_penalty=1.3, frequency_penalty=0.5,
        min_tokens=5, stop_token_ids=[2],
    )  # fmt: skip
    outputs = [4, 30, 4]
    at_once, one_by_one, resumed = (SamplingTable(VOCAB) for _ in range(3))
    for table in (at_once, one_by_one):
        table.add_request(3, params, [10, 11], bad_words_ids=[[4, 5]])
    resumed.add_request(3, params, [10, 11], bad_words_ids=[[4, 5]], output_token_ids=outputs)
    at_once.append_tokens(np.array([3, 3, 3]), np.array(outputs))
    for token in outputs:
        one_by_one.append_tokens(np.array([3]), np.array([token]))
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    batches = [table.batch(np.array([3])) for table in (at_once, one_by_one, resumed)]
    first = batches[0]
    assert first.penalties.output_counts[0, 4] == 2 and first.penalties.output_counts[0, 30] == 1
    # the bad word [4, 5] bans 5 after a 4
    assert sorted(first.blocked_ids.tolist()) == [5]
    for batch in batches[1:]:
        assert torch.equal(batch.penalties.output_counts, first.penalties.output_counts)
        assert sorted(batch.blocked_ids.tolist()) == sorted(first.blocked_ids.tolist())
        assert torch.equal(batch.seeded_keys, first.seeded_keys)
    drawn = [Sampler(seed=0)(logits.clone(), batch).tokens.tolist() for batch in batches]
    assert drawn[0] == drawn[1] == drawn[2]
