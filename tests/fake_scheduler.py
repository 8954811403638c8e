"""A small Python stand-in for the Rust scheduler: it builds StepPlans the way the core does
(prefill chunks and decodes in one batch, new blocks, slot mapping, sampled rows) and sends
them to a ModelRunner as RunnerSteps."""

from dataclasses import dataclass, field

import numpy as np

from aieng.runner_io import NewSamplingRow, RunnerStep
from aieng.sampling import SamplingParams


@dataclass
class StepPlan:
    num_requests: int
    num_tokens: int
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    num_computed_tokens: np.ndarray
    seq_lens: np.ndarray
    new_block_slots: np.ndarray
    new_block_indices: np.ndarray
    new_block_ids: np.ndarray
    logits_indices: np.ndarray
    sample_request_rows: np.ndarray
    slots: np.ndarray
    request_ids: list[str]

    def grammar_bitmask(self) -> None:
        """No structured outputs in these plans."""
        return None


@dataclass
class Request:
    request_id: str
    slot: int
    prompt: list[int]
    params: SamplingParams
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.params.max_tokens


class FakeScheduler:
    def __init__(self, runner, chunk_size: int | None = None):
        self.runner = runner
        self.block_size = runner.block_size
        self.chunk_size = chunk_size
        self.free_blocks = list(range(runner.num_blocks))[::-1]  # hand out high ids first
        self.added: list[NewSamplingRow] = []
        self.requests: list[Request] = []
        self.next_slot = 5  # slots need not start at 0 nor be dense

    def add(
        self,
        prompt: list[int],
        params: SamplingParams,
        cached_blocks: list[int] = (),
    ) -> Request:
        """cached_blocks: full blocks already holding the prompt's first tokens (a prefix hit)."""
        slot, self.next_slot = self.next_slot, self.next_slot + 3
        request = Request(f"req-{slot}", slot, list(prompt), params, blocks=list(cached_blocks))
        request.num_computed = len(cached_blocks) * self.block_size
        self.added.append(NewSamplingRow(slot, params, list(prompt)))
        self.requests.append(request)
        return request

    def run(self) -> list[Request]:
        while self.step():
            pass
        return self.requests

    def step(self) -> bool:
        running = [r for r in self.requests if not r.finished]
        if not running:
            return False
        plan = self._plan(running)
        out = self.runner.execute(RunnerStep(plan, self.added))
        self.added = []
        assert out.num_sampled.tolist() == [1] * len(plan.sample_request_rows)
        logprobs = out.logprobs
        of_row = {int(s): i for i, s in enumerate(logprobs.rows)}
        for s, row in enumerate(plan.sample_request_rows):
            request = running[row]
            request.output.append(int(out.sampled_token_ids[s]))
            if s in of_row:
                i = of_row[s]
                request.logprobs.append(float(logprobs.chosen[i]))
                n = logprobs.num_top[i]
                ids, values = logprobs.top_ids[i, :n], logprobs.top_logprobs[i, :n]
                top = zip(ids.tolist(), values.tolist(), strict=True)
                request.top_logprobs.append(dict(top))
        return True

    def _plan(self, running: list[Request]) -> StepPlan:
        input_ids, positions, slot_mapping, query_start_loc = [], [], [], [0]
        num_computed, seq_lens, logits_indices, sample_rows = [], [], [], []
        for row, request in enumerate(running):
            tokens = request.tokens
            count = len(tokens) - request.num_computed
            if self.chunk_size is not None:
                count = min(count, self.chunk_size)
            start, end = request.num_computed, request.num_computed + count
            while len(request.blocks) * self.block_size < end:
                request.blocks.append(self.free_blocks.pop())
            input_ids += tokens[start:end]
            positions += range(start, end)
            slot_mapping += [
                request.blocks[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)
            ]
            query_start_loc.append(query_start_loc[-1] + count)
            num_computed.append(start)
            seq_lens.append(end)
            if end == len(tokens):
                logits_indices.append(query_start_loc[-1] - 1)
                sample_rows.append(row)
            request.num_computed = end
        # Every block of every running request, every step: re-applying one is harmless.
        block_slots = [r.slot for r in running for _ in r.blocks]
        block_indices = [i for r in running for i in range(len(r.blocks))]
        block_ids = [b for r in running for b in r.blocks]

        def i32(values):
            return np.asarray(values, dtype=np.int32)

        return StepPlan(
            num_requests=len(running),
            num_tokens=len(input_ids),
            input_ids=i32(input_ids),
            positions=i32(positions),
            slot_mapping=i32(slot_mapping),
            query_start_loc=i32(query_start_loc),
            num_computed_tokens=i32(num_computed),
            seq_lens=i32(seq_lens),
            new_block_slots=i32(block_slots),
            new_block_indices=i32(block_indices),
            new_block_ids=i32(block_ids),
            logits_indices=i32(logits_indices),
            sample_request_rows=i32(sample_rows),
            slots=i32([r.slot for r in running]),
            request_ids=[r.request_id for r in running],
        )
