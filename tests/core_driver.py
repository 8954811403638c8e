"""Drives a ModelRunner with plans from the real Rust core (`aieng._core.EngineCore`): the
scheduling the engine does — chunked prefill, prefill and decode rows in one step, prefix-cache
hits, slots — without the engine's output processing, for model and kernel tests that hold the
runner's tokens and logprobs to HF's. Requests run to `max_tokens` (EOS does not stop them, as
HF's greedy reference runs)."""

from dataclasses import dataclass, field

import numpy as np

from aieng._core import EngineCore
from aieng.sampling import SamplingParams
from aieng.worker.runner_io import NewSamplingRow, RunnerStep


@dataclass
class Request:
    request_id: str
    slot: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens the core found in its prefix cache
    finished: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class CoreDriver:
    def __init__(self, runner, chunk_size: int | None = None, max_num_seqs: int = 64):
        """chunk_size: at most this many prompt tokens of a request per step (the core's
        long_prefill_token_threshold); None: whole prompts, within the step's token budget."""
        self.runner = runner
        budget = runner.max_num_batched_tokens  # what the runner's input buffers hold
        self.core = EngineCore(
            num_blocks=runner.num_blocks,
            block_size=runner.block_size,
            max_num_seqs=min(max_num_seqs, budget),
            max_num_batched_tokens=budget,
            max_model_len=runner.max_model_len,
            enable_prefix_caching=True,
            long_prefill_token_threshold=chunk_size or 0,
        )
        self.requests: list[Request] = []
        self._by_slot: dict[int, Request] = {}
        self._added: list[NewSamplingRow] = []
        self._finished_slots: list[int] = []

    def add(self, prompt: list[int], params: SamplingParams) -> Request:
        request_id = f"req-{len(self.requests)}"
        slot = self.core.add_request(
            request_id, list(prompt), max_tokens=params.max_tokens, ignore_eos=True
        )
        request = Request(request_id, slot, list(prompt), params)
        self._added.append(NewSamplingRow(slot, params, list(prompt)))
        self._by_slot[slot] = request
        self.requests.append(request)
        return request

    def run(self) -> list[Request]:
        while self.step():
            pass
        if self._finished_slots:  # the runner lets go of the finished rows' sampling state
            plan = self.core.schedule()
            self.runner.execute(RunnerStep(plan, [], self._finished_slots))
            self.core.update(np.zeros(0, np.int64))
            self._finished_slots = []
        return self.requests

    def step(self) -> bool:
        """One step of the core's plan through the runner; False when nothing is left."""
        if not self.core.has_unfinished():
            return False
        plan = self.core.schedule()
        step = RunnerStep(plan, self._added, self._finished_slots)
        self._added, self._finished_slots = [], []
        out = self.runner.execute(step)
        slots = np.asarray(plan.slots)
        for slot in slots.tolist():
            request = self._by_slot[slot]
            if request.num_cached_tokens == 0:
                request.num_cached_tokens = self.core.num_cached_tokens(request.request_id) or 0
        tokens = out.sampled_token_ids
        assert out.num_sampled.tolist() == [1] * len(tokens)
        assert (tokens >= 0).all(), out.failed_slots
        of_row = {int(s): i for i, s in enumerate(out.logprobs.rows)}
        for s, row in enumerate(np.asarray(plan.sample_request_rows).tolist()):
            request = self._by_slot[int(slots[row])]
            request.output.append(int(tokens[s]))
            if s in of_row:
                i = of_row[s]
                lp = out.logprobs
                request.logprobs.append(float(lp.chosen[i]))
                n = lp.num_top[i]
                top = zip(lp.top_ids[i, :n].tolist(), lp.top_logprobs[i, :n].tolist(), strict=True)
                request.top_logprobs.append(dict(top))
        for done in self.core.update(tokens).finished:
            request = next(r for r in self.requests if r.request_id == done.request_id)
            request.finished = True
            self._finished_slots.append(request.slot)
            del self._by_slot[request.slot]
        return True
