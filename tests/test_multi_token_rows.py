"""Several accepted tokens per sampled row (what speculative decoding returns), through the
engine: every token reaches the output in order, every stop check applies to each of them, and
the tokens after the first are computed as the request's next query tokens."""

import numpy as np
import pytest
from text_fixtures import byte_level_bpe, save_model_dir
from tiny_models import build_checkpoint

from aieng import LLM, SamplingParams
from aieng.runner_io import ModelRunnerOutput

VOCAB = 384


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multi")
    save_model_dir(folder, byte_level_bpe(VOCAB))
    build_checkpoint("llama", folder, vocab_size=VOCAB)
    return LLM(str(folder), max_num_seqs=4, kv_cache_memory=1 << 22, block_size=4)


def with_extra_tokens(llm, monkeypatch, extra: list[int]):
    """Each row's sampled token is followed by the tokens `extra`, as if they were accepted."""
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


def test_every_accepted_token_is_output_and_computed_next(llm, monkeypatch):
    plans = with_extra_tokens(llm, monkeypatch, [7, 8])
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    [out] = llm.generate([[5, 6, 9, 10, 11]], params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 9 and tokens[1:3] == [7, 8] and tokens[4:6] == [7, 8]
    # After the first step each step runs the three tokens the last one accepted.
    assert [len(p.input_ids) for p in plans] == [5, 3, 3]
    assert plans[1].input_ids.tolist() == tokens[:3]
    llm.engine.check_pool_whole()


def test_a_stop_inside_a_row_drops_the_rest(llm, monkeypatch):
    with_extra_tokens(llm, monkeypatch, [7, 8, 9])
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[8])
    [out] = llm.generate([[5, 6, 9, 10, 11]], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids[-2:] == [7, 8] and completion.finish_reason == "stop"
    assert completion.stop_reason == 8
    llm.engine.check_pool_whole()
