"""SamplingParams validation and the batched sampler on synthetic logits."""

import math

import numpy as np
import pytest
import torch

from aieng.sampling import SamplingParams
from aieng.worker.runner_io import SampledLogprobs
from aieng.worker.sampler import Sampler, SamplingTable, apply_penalties, seeded_exponential

VOCAB = 32


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("frequency_penalty", math.inf),
        ("seed", 1.0),
        ("stop", ""),
        ("stop", ["a", ""]),
        ("stop", [1]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", 5),
        ("max_tokens", -1),
        ("max_tokens", None),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("ignore_eos", 1),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_valid_params():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_k, params.max_tokens) == (1, 1.0, 0, 16)
    assert not params.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(top_k=-1, seed=-5, logprobs=0).top_k == -1


def run(rows, logits, sampler=None, steps=1, prompts=None, banned=None):
    """Sample `steps` times from fixed logits; rows: SamplingParams per row; banned(step) ->
    the plan's (rows, ids) bans of that step, or None. -> (steps, S) ids."""
    table = SamplingTable(VOCAB, capacity=2)
    slots = [10 + 7 * i for i in range(len(rows))]
    for i, (slot, params) in enumerate(zip(slots, rows, strict=True)):
        table.add_request(slot, params, prompts[i] if prompts else [])
    sampler = sampler or Sampler(seed=0)
    out = []
    for step in range(steps):
        batch = table.batch(np.array(slots), banned(step) if banned else None)
        sampled = sampler(logits.clone(), batch)
        tokens = sampled.tokens.numpy()
        table.append_tokens(batch.slots, tokens)
        out.append(tokens)
    logprobs = sampled.logprobs.to_host() if sampled.logprobs else SampledLogprobs.empty()
    return np.stack(out), logprobs


def skewed_logits(rows):
    torch.manual_seed(0)
    return torch.randn(rows, VOCAB) * 2


def test_greedy_is_argmax_and_logprobs_are_raw():
    logits = skewed_logits(3)
    tokens, logprobs = run([SamplingParams(temperature=0, logprobs=4)] * 3, logits)
    assert (tokens[0] == logits.argmax(-1).numpy()).all()
    raw = torch.log_softmax(logits, -1)
    np.testing.assert_allclose(logprobs.chosen, raw.max(-1).values.numpy(), atol=1e-6)
    np.testing.assert_array_equal(logprobs.top_ids, raw.topk(4).indices.numpy())
    assert logprobs.num_top.tolist() == [4, 4, 4]


def test_reported_logprobs_ignore_temperature_and_penalties():
    logits = skewed_logits(1)
    params = SamplingParams(temperature=0.3, repetition_penalty=2.0, seed=3, logprobs=0)
    tokens, logprobs = run([params], logits, prompts=[[0, 1, 2]])
    raw = torch.log_softmax(logits[0], -1)
    assert logprobs.chosen[0] == pytest.approx(raw[tokens[0, 0]].item(), abs=1e-6)


def test_filters_restrict_support():
    logits = skewed_logits(1).expand(4, VOCAB)
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    rows = [
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.3),
        SamplingParams(top_k=1, temperature=5.0),
    ]
    tokens, _ = run(rows, logits, steps=300)
    assert set(tokens[:, 0]) <= set(order[:3].tolist())
    top_p_set = order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist()
    assert set(tokens[:, 1]) <= set(top_p_set)
    assert set(tokens[:, 2]) <= set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    assert set(tokens[:, 3]) == {order[0].item()}
    assert len(set(tokens[:, 0])) > 1  # it does sample


def test_temperature_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4)])
    tokens, _ = run([SamplingParams(temperature=0.5)], logits, steps=4000)
    frequencies = np.bincount(tokens[:, 0], minlength=VOCAB)[:4] / 4000
    expected = (logits[0, :4] / 0.5).softmax(-1).numpy()
    np.testing.assert_allclose(frequencies, expected, atol=0.03)


def test_penalties_follow_vllm():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0] + [0.0] * (VOCAB - 4)])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    table = SamplingTable(VOCAB)
    table.add_request(0, params, prompt_token_ids=[0, 1], output_token_ids=[3, 3])
    out = apply_penalties(logits.clone(), table.batch(np.array([0])).penalties)[0, :4]
    expected = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.5 * 2 - 0.25]
    torch.testing.assert_close(out, torch.tensor(expected))


def test_repetition_penalty_steers_greedy_away():
    logits = torch.tensor([[5.0, 4.0] + [0.0] * (VOCAB - 2)])
    tokens, _ = run([SamplingParams(temperature=0, repetition_penalty=2.0)], logits, prompts=[[0]])
    assert tokens[0, 0] == 1


def test_frequency_penalty_accumulates_over_outputs():
    logits = torch.tensor([[1.0, 0.9] + [-5.0] * (VOCAB - 2)])
    params = SamplingParams(temperature=0, frequency_penalty=0.3)
    tokens, _ = run([params], logits, steps=4)
    assert tokens[:, 0].tolist() == [0, 1, 0, 1]


def test_the_plans_bans_are_applied_to_their_rows():
    """The core decides min_tokens (which rows may not draw which EOS and stop ids); the sampler
    applies the bans the plan lists, row by row (tests/test_llm.py holds the two together)."""
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0] + [0.0] * (VOCAB - 4)]).expand(3, VOCAB)
    rows = [SamplingParams(temperature=0)] * 3

    def banned(step):  # row 0: EOS 2 and stop id 3 for two steps; row 1: only 2, first step
        if step >= 2:
            return None
        plan_rows, ids = [0, 0] + ([1] if step == 0 else []), [2, 3] + ([2] if step == 0 else [])
        return np.array(plan_rows, np.int32), np.array(ids, np.int32)

    tokens, _ = run(rows, logits, steps=3, banned=banned)
    assert tokens[:, 0].tolist() == [0, 0, 2]
    assert tokens[:, 1].tolist() == [3, 2, 2]
    assert tokens[:, 2].tolist() == [2, 2, 2]


def test_seeded_rows_reproduce_whatever_the_batch():
    logits = skewed_logits(1)
    seeded = SamplingParams(seed=1234, temperature=1.5)
    alone, _ = run([seeded], logits, steps=20)
    crowd = [
        SamplingParams(temperature=1.0),
        SamplingParams(seed=7),
        seeded,
        SamplingParams(top_k=4),
    ]
    batched, _ = run(crowd, logits.expand(4, VOCAB), sampler=Sampler(seed=99), steps=20)
    np.testing.assert_array_equal(alone[:, 0], batched[:, 2])
    other_seed, _ = run([SamplingParams(seed=1235, temperature=1.5)], logits, steps=20)
    assert (alone != other_seed).any()
    assert len(set(alone[:, 0])) > 1  # each output index draws new noise


def test_seeded_token_depends_on_its_output_index_not_the_step():
    logits = skewed_logits(1)
    seeded = SamplingParams(seed=5)
    reference, _ = run([seeded], logits, steps=6)
    table = SamplingTable(VOCAB)
    # The same request resumed after 3 outputs (e.g. recomputed after preemption).
    table.add_request(2, seeded, [], output_token_ids=reference[:3, 0].tolist())
    tokens = Sampler(seed=123)(logits.clone(), table.batch(np.array([2]))).tokens
    assert tokens[0] == reference[3, 0]


def test_unseeded_rows_use_the_engine_generator():
    logits = skewed_logits(1)
    first, _ = run([SamplingParams()], logits, sampler=Sampler(seed=1), steps=30)
    again, _ = run([SamplingParams()], logits, sampler=Sampler(seed=1), steps=30)
    other, _ = run([SamplingParams()], logits, sampler=Sampler(seed=2), steps=30)
    np.testing.assert_array_equal(first, again)
    assert (first != other).any()


def test_mixed_rows_in_one_batch():
    logits = skewed_logits(5)
    rows = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=1),
        SamplingParams(temperature=0, repetition_penalty=100.0),
        SamplingParams(seed=3, top_p=0.9),
        SamplingParams(temperature=0, logprobs=2),
    ]
    prompts = [[], [], [int(logits[2].argmax())], [], []]
    tokens, logprobs = run(rows, logits, prompts=prompts)
    argmax = logits.argmax(-1)
    assert tokens[0, 0] == argmax[0] and tokens[0, 1] == argmax[1] and tokens[0, 4] == argmax[4]
    assert tokens[0, 2] != argmax[2]
    assert logprobs.rows.tolist() == [4] and logprobs.num_top.tolist() == [2]
    assert logprobs.top_ids.shape == (1, 2)  # logprobs only for the row that asked


def test_table_grows_and_reuses_slots():
    table = SamplingTable(VOCAB, capacity=1)
    table.add_request(40, SamplingParams(repetition_penalty=1.5), [1, 2])
    table.add_request(3, SamplingParams(), [1])
    assert table.capacity > 40 and table.output_counts.shape[0] == table.capacity
    table.add_request(40, SamplingParams(temperature=0), [7])  # slot reused by a new request
    batch = table.batch(np.array([40]))
    assert bool(batch.greedy[0]) and batch.all_greedy and batch.penalties is None


def test_a_row_without_a_valid_token_fails_alone():
    logits = skewed_logits(3)
    logits[0] = math.nan  # a broken row: no token has a probability
    logits[1, 7] = math.nan  # one NaN also breaks a row: it is never drawn
    logits[2, 3] = math.nan
    rows = [SamplingParams(temperature=0)] * 3 + [SamplingParams(seed=1)] * 2
    tokens, _ = run(rows, torch.cat([logits, logits[1:]]), steps=20)
    assert (tokens[:, :3] == -1).all() and (tokens[:, 3:] == -1).all()
    fine = skewed_logits(2)
    tokens, _ = run([SamplingParams(temperature=0), SamplingParams(seed=1)], fine, steps=20)
    assert (tokens[:, 0] == int(fine[0].argmax())).all() and (tokens[:, 1] >= 0).all()


def test_a_fully_masked_sampled_row_fails():
    logits = torch.full((1, VOCAB), -math.inf)
    tokens, _ = run([SamplingParams(temperature=0.7)], logits)
    assert tokens[0, 0] == -1


def test_seeded_noise_is_exponential_and_keyed():
    keys = torch.tensor([[1, 2], [1, 3]], dtype=torch.int64)
    noise = seeded_exponential(keys, 1 << 16)
    assert noise.shape == (2, 1 << 16) and bool((noise > 0).all())
    assert abs(noise.mean().item() - 1.0) < 0.02 and abs(noise.var().item() - 1.0) < 0.05
    assert torch.equal(noise, seeded_exponential(keys, 1 << 16))
    assert not torch.equal(noise[0], noise[1])


def test_zero_exponential_noise_on_an_impossible_token_never_fails_the_row():
    """Seeded Exp(1) noise is exactly 0 for about one (row, token) in 2**24 (a uniform that
    rounds to 1 in float32): on a token of probability 0 the race was 0 / 0 = NaN, which argmax
    picked, failing a healthy request ('no valid token'). Found by a 30-second load test."""
    from aieng.worker.sampler import exponential_race, seeded_exponential

    probs = torch.tensor([[0.0, 0.7, 0.3], [0.5, 0.0, 0.5], [0.0, 0.0, 0.0]])
    noise = torch.tensor([[0.0, 1.0, 1.0], [2.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    assert exponential_race(probs, noise).tolist() == [1, 2, -1]
    # a token with probability and zero noise wins, as the race's limit says
    assert exponential_race(torch.tensor([[0.2, 0.8]]), torch.tensor([[0.0, 1.0]])).tolist() == [0]
    # the seeded noise really reaches 0: the largest 24-bit uniform rounds to 1.0 in float32
    keys = torch.tensor([[0, 0]], dtype=torch.int64)
    assert seeded_exponential(keys, 1 << 16).min() >= 0
    top = torch.tensor([(1 << 24) - 1], dtype=torch.int64)
    assert float(-torch.log((top.float() + 0.5) * (1.0 / (1 << 24)))) == 0.0
