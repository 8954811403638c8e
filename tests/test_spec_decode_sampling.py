"""Rejection sampling on a tiny vocabulary: the tokens speculative decoding emits are drawn
from the very distributions plain decoding draws from — with temperature, top-p and a
repetition penalty that counts the accepted draft (verified position by position), and without
the penalty (every position in one pass) — checked by the total-variation distance
between many speculative and plain samples (fixed seeds), against the distance that a wrong
distribution shows."""

import numpy as np
import pytest
import torch

from aieng.sampling import SamplingParams
from aieng.worker.isolated_sampling import RowRules
from aieng.worker.runner_io import SampledLogprobs
from aieng.worker.sampler import Sampler, SamplerOutput, SamplingTable
from aieng.worker.spec_verify import draft_tokens, sampling_groups, verify_and_sample

VOCAB = 8
N = 6_000
DRAFT = 2
PENALISED = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.8, max_tokens=8)
PLAIN = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8)
FIRST = torch.tensor([0.5, 1.0, 1.2, 0.2, -0.5, 0.9, 0.1, -2.0])  # logits at position 0
SECOND = torch.tensor([0.3, 0.2, 1.5, 1.1, 0.0, -0.3, 0.8, -1.0])  # after the draft


def to_host(out: SamplerOutput) -> tuple[np.ndarray, SampledLogprobs]:
    return out.tokens.numpy(), SampledLogprobs.empty()


def table(params: SamplingParams) -> SamplingTable:
    t = SamplingTable(VOCAB, capacity=N)
    for slot in range(N):
        t.add_request(slot, params, [1])
    return t


def counts(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=VOCAB)


def distance(a: np.ndarray, b: np.ndarray) -> float:
    """Total-variation distance between the two samples' token frequencies."""
    return 0.5 * float(np.abs(counts(a) / len(a) - counts(b) / len(b)).sum())


def speculative_samples(params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Every request verifies one draft: (first tokens (N,), second tokens where accepted)."""
    slots = np.repeat(np.arange(N), 2)
    logits = torch.stack([FIRST, SECOND]).repeat(N, 1)  # (2N, V)
    drafts = np.tile([DRAFT, -1], N)
    groups = (np.arange(0, 2 * N, 2), np.full(N, 2))
    tokens, taken, _, failed = verify_and_sample(
        Sampler(seed=0), table(params), logits, slots, drafts, groups, RowRules(), to_host
    )
    assert not failed and set(taken.tolist()) <= {1, 2}
    starts = np.r_[0, np.cumsum(taken)[:-1]]
    first = tokens[starts]
    accepted = taken == 2
    assert np.array_equal(accepted, first == DRAFT), "accepted exactly when it drew the draft"
    return first, tokens[starts[accepted] + 1]


def plain_samples(
    params: SamplingParams, count_the_draft: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Plain decoding, one token a step: the second only after the draft's token."""
    sampler, state = Sampler(seed=1), table(params)
    slots = np.arange(N)
    first = sampler(FIRST.repeat(N, 1), state.batch(slots)).tokens.numpy()
    if count_the_draft:
        state.append_tokens(slots, first)
    follow = slots[first == DRAFT]
    batch = state.batch(follow)
    second = sampler(SECOND.repeat(len(follow), 1), batch).tokens.numpy()
    return first, second


@pytest.mark.parametrize("params", [PENALISED, PLAIN], ids=["penalty", "one-pass"])
def test_speculative_and_plain_sampling_draw_the_same_distribution(params):
    spec_first, spec_second = speculative_samples(params)
    plain_first, plain_second = plain_samples(params)
    assert len(spec_second) > 1000 and len(plain_second) > 1000
    # Two samples of 6,000 (and ~1,800) from one distribution over 8 tokens lie about 0.02
    # (0.035) apart; the bounds are twice that.
    assert distance(spec_first, plain_first) < 0.04
    assert distance(spec_second, plain_second) < 0.07
    if params is PENALISED:  # the test tells distributions apart: forgetting that the
        # accepted draft counts for the penalty gives another second token
        _, unpenalised = plain_samples(params, count_the_draft=False)
        assert distance(spec_second, unpenalised) > 0.1


def test_a_plain_greedy_step_takes_the_samplers_tokens_without_its_batch():
    """The common decode step (greedy rows without drafts, rules or logprobs) is sampled by
    argmax alone: the same tokens as the sampler's, -1 where the argmax's logit is not finite,
    and the table counts the taken tokens as the sampler's path does."""
    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.standard_normal((5, VOCAB)).astype(np.float32))
    logits[1, 3] = float("nan")  # a NaN row: its argmax is there, and it fails
    logits[2] = float("-inf")  # nothing can be drawn
    logits[4, :] = 0.25  # ties: the first
    greedy = SamplingParams(temperature=0, max_tokens=8)
    fast, slow = table(greedy), table(greedy)
    slots = np.arange(5)
    one_each = (np.arange(5), np.ones(5, np.int64))
    tokens, taken, logprobs, failed = verify_and_sample(
        Sampler(seed=0), fast, logits, slots, np.full(5, -1), one_each, RowRules(), to_host
    )
    reference = Sampler(seed=0)(logits, slow.batch(slots)).tokens.numpy()
    assert tokens.tolist() == reference.tolist()
    assert tokens[1] == -1 and tokens[2] == -1 and tokens[4] == 0
    assert taken.tolist() == [1] * 5 and not failed and len(logprobs.rows) == 0
    slow.append_tokens(slots[reference >= 0], reference[reference >= 0])
    assert fast.num_output[:5].tolist() == slow.num_output[:5].tolist() == [1, 0, 0, 1, 1]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, logprobs=1),
        SamplingParams(temperature=0, repetition_penalty=1.3),
        SamplingParams(temperature=0, logit_bias={2: 5.0}),
        SamplingParams(temperature=0.7, seed=3),
    ],
    ids=["logprobs", "penalty", "bias", "sampled"],
)
def test_rows_that_process_their_logits_take_the_samplers_path(params):
    state = table(params)
    assert not state.plain_greedy(np.arange(3))
    assert table(SamplingParams(temperature=0)).plain_greedy(np.arange(3))
    # One such slot among plain ones: only steps holding it leave the fast path; its slot
    # taken over by a plain request, or removed, leaves no trace.
    mixed = table(SamplingParams(temperature=0))
    mixed.add_request(1, params, [1])
    assert not mixed.plain_greedy(np.array([0, 1, 2]))
    assert mixed.plain_greedy(np.array([0, 2]))
    mixed.add_request(1, SamplingParams(temperature=0), [1])
    assert mixed.plain_greedy(np.arange(3))
    mixed.add_request(2, params, [1])
    mixed.remove_request(2)
    assert mixed.plain_greedy(np.arange(2)) and not mixed.not_plain


class _Plan:
    def __init__(self, input_ids, logits_indices):
        self.input_ids = np.array(input_ids, np.int32)
        self.logits_indices = np.array(logits_indices, np.int32)


@pytest.mark.parametrize(
    ("rows", "indices", "starts", "sizes", "drafts"),
    [
        ([], [], [], [], []),
        ([4], [9], [0], [1], [-1]),
        ([0, 2, 3], [1, 5, 9], [0, 1, 2], [1, 1, 1], [-1, -1, -1]),  # no drafts
        ([0, 0, 0, 2], [0, 1, 2, 9], [0, 3], [3, 1], [11, 12, -1, -1]),  # 2 drafts, then none
        ([1, 3, 3], [4, 7, 8], [0, 1], [1, 2], [-1, 18, -1]),
    ],
)
def test_sampling_groups_and_their_drafts(rows, indices, starts, sizes, drafts):
    groups = sampling_groups(np.array(rows, np.int32))
    assert groups[0].tolist() == starts and groups[1].tolist() == sizes
    plan = _Plan([10 + i for i in range(10)], indices)
    assert draft_tokens(plan, groups).tolist() == drafts
