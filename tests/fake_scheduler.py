"""A small Python stand-in for the Rust scheduler: it builds StepPlans the way the core does
(prefill chunks and decodes in one batch, block tables, slot mapping, sampled rows)."""

from dataclasses import dataclass, field

import numpy as np

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
    block_tables: np.ndarray
    logits_indices: np.ndarray
    sample_request_rows: np.ndarray
    slots: np.ndarray
    request_ids: list[str]


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
    def __init__(self, runner, chunk_size: int | None = None, eos_token_ids=()):
        self.runner = runner
        self.block_size = runner.block_size
        self.chunk_size = chunk_size
        self.eos_token_ids = eos_token_ids
        self.free_blocks = list(range(runner.num_blocks))[::-1]  # hand out high ids first
        self.table = runner.new_sampling_table(capacity=4)
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
        self.table.add_request(slot, params, prompt, eos_token_ids=self.eos_token_ids)
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
        batch = self.table.batch(plan)
        token_ids, logprobs = self.runner.execute(plan, batch)
        self.table.append_tokens(batch, token_ids)
        for s, row in enumerate(plan.sample_request_rows):
            request = running[row]
            request.output.append(int(token_ids[s]))
            request.logprobs.append(float(logprobs.chosen[s]))
            n = logprobs.num_top[s]
            request.top_logprobs.append(
                dict(
                    zip(
                        logprobs.top_ids[s, :n].tolist(),
                        logprobs.top_logprobs[s, :n].tolist(),
                        strict=True,
                    )
                )
            )
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
        max_blocks = max(len(r.blocks) for r in running)
        block_tables = np.zeros((len(running), max_blocks), np.int32)
        for row, request in enumerate(running):
            block_tables[row, : len(request.blocks)] = request.blocks

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
            block_tables=block_tables,
            logits_indices=i32(logits_indices),
            sample_request_rows=i32(sample_rows),
            slots=i32([r.slot for r in running]),
            request_ids=[r.request_id for r in running],
        )
