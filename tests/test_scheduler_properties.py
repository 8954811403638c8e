"""Random interleavings of add / schedule / update / abort under tiny pools.

After every step the core's invariants hold; when everything has finished or been
aborted the scheduler is empty and every block is free or evictable; every request
either finishes with the right number of tokens for its reason or was aborted. A
runner's block tables, kept only from each plan's new blocks, always hold every
scheduled row's blocks; an update may give a row several tokens.
"""

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import aieng
from aieng.core import EngineCore

EOS = 1
STOP = 2
VOCAB = 6  # tiny, so EOS/stop tokens and shared prefixes are frequent


@dataclass
class Tracked:
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    output: list[int] = field(default_factory=list)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(2, 24),
        block_size=st.sampled_from([1, 2, 3, 4, 8]),
        max_num_seqs=st.integers(1, 5),
        extra_budget=st.integers(0, 12),
        max_model_len=st.integers(2, 40),
        prefix_caching=st.booleans(),
        threshold=st.sampled_from([0, 1, 3]),
    )
    def setup(
        self,
        num_blocks,
        block_size,
        max_num_seqs,
        extra_budget,
        max_model_len,
        prefix_caching,
        threshold,
    ):
        self.core = EngineCore(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_seqs + extra_budget,
            max_model_len=max_model_len,
            enable_prefix_caching=prefix_caching,
            long_prefill_token_threshold=threshold,
        )
        self.num_blocks, self.block_size, self.max_model_len = (
            num_blocks,
            block_size,
            max_model_len,
        )
        self.budget = max_num_seqs + extra_budget
        self.live: dict[str, Tracked] = {}
        self.next_id = 0
        self.tables: dict[int, list[int]] = {}  # a runner's block table per slot

    @rule(
        prompt=st.lists(st.integers(3, VOCAB), min_size=0, max_size=30),
        shared=st.booleans(),
        max_tokens=st.integers(1, 12),
        min_tokens=st.integers(0, 4),
        ignore_eos=st.booleans(),
        priority=st.integers(0, 2),
        client=st.sampled_from([None, "a", "b"]),  # several clients: shared step budgets
    )
    def add(self, prompt, shared, max_tokens, min_tokens, ignore_eos, priority, client):
        if shared:
            prompt = [3, 4, 5, 6, 3, 4, 5, 6][: len(prompt)] + prompt
        min_tokens = min(min_tokens, max_tokens)
        rid = f"r{self.next_id}"
        self.next_id += 1
        slots = min(len(prompt) + max_tokens, self.max_model_len) - 1
        fits = 0 < len(prompt) < self.max_model_len and -(-slots // self.block_size) <= (
            self.num_blocks
        )
        try:
            self.core.add_request(
                rid,
                prompt,
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                ignore_eos=ignore_eos,
                eos_token_ids=[EOS],
                stop_token_ids=[STOP],
                priority=priority,
                client=client,
            )
        except aieng.InvalidArgumentError:
            assert not fits
            return
        assert fits
        self.live[rid] = Tracked(prompt, max_tokens, min_tokens, ignore_eos)

    @precondition(lambda self: self.live)
    @rule(
        data=st.data(),
        abort_in_flight=st.booleans(),
        several=st.booleans(),
    )
    def step(self, data, abort_in_flight, several):
        plan = self.core.schedule()
        assert plan.num_tokens <= self.budget
        self.check_new_blocks(plan)
        n = len(plan.logits_indices)
        counts = data.draw(st.lists(st.integers(1, 3), min_size=n, max_size=n)) if several else []
        total = sum(counts) if several else n
        sampled = data.draw(st.lists(st.integers(1, VOCAB), min_size=total, max_size=total))
        offered, start = {}, 0
        for row, k in zip(plan.sample_request_rows.tolist(), counts or [1] * n, strict=True):
            offered[row] = sampled[start : start + k]
            start += k
        ids = plan.request_ids
        if abort_in_flight and ids:
            self.forget(self.core.abort(ids[0]).slot)
            self.live.pop(ids[0])
        out = self.core.update(
            np.array(sampled, dtype=np.int64),
            num_sampled=np.array(counts) if several else None,
        )
        got = defaultdict(list)
        for row, tok in zip(out.rows.tolist(), out.token_ids.tolist(), strict=True):
            got[row].append(tok)
        finished = {done.request_id for done in out.finished}
        for row, tokens in got.items():
            assert tokens == offered[row][: len(tokens)], "a row's tokens are appended in order"
            assert len(tokens) == len(offered[row]) or ids[row] in finished
            self.live[ids[row]].output.extend(tokens)
        for done in out.finished:
            self.forget(done.slot)
            self.check_finished(self.live.pop(done.request_id), done)

    def check_new_blocks(self, plan):
        """Each table is reported from its first block, each block once, and the first
        ceil(seq_len / block_size) blocks of every scheduled row's table are its blocks."""
        new = zip(
            plan.new_block_slots.tolist(),
            plan.new_block_indices.tolist(),
            plan.new_block_ids.tolist(),
            strict=True,
        )
        for slot, index, block in new:
            table = self.tables.setdefault(slot, [])
            if index == 0:
                table.clear()
            assert index == len(table)
            table.append(block)
        rows = zip(plan.request_ids, plan.slots.tolist(), plan.seq_lens.tolist(), strict=True)
        for rid, slot, seq_len in rows:
            used = -(-seq_len // self.block_size)
            assert self.tables[slot][:used] == self.core.block_ids(rid)[:used]

    def forget(self, slot):
        """A runner may drop the table of a request that ended."""
        self.tables.pop(slot, None)

    def check_finished(self, req: Tracked, done):
        n = len(req.output)
        assert done.num_output_tokens == n
        if done.finish_reason == "length":
            assert n == req.max_tokens or len(req.prompt) + n == self.max_model_len
        else:
            assert done.finish_reason == "stop"
            last = req.output[-1]
            assert done.stop_reason == last
            assert last == STOP or (last == EOS and not req.ignore_eos)
            assert n >= req.min_tokens
        # No earlier token should have stopped it.
        for i, tok in enumerate(req.output[:-1]):
            stoppable = tok == STOP or (tok == EOS and not req.ignore_eos)
            assert not (stoppable and i + 1 >= req.min_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        done = self.core.abort(rid)
        assert done.finish_reason == "abort"
        self.forget(done.slot)
        self.live.pop(rid)

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "core"):
            self.core.check_invariants()
            assert self.core.num_running + self.core.num_waiting == len(self.live)

    def teardown(self):
        if not hasattr(self, "core"):
            return
        for _ in range(2000):
            if not self.core.has_unfinished():
                break
            plan = self.core.schedule()
            out = self.core.update(np.full(len(plan.logits_indices), 3, dtype=np.int64))
            for row, tok in zip(out.rows.tolist(), out.token_ids.tolist(), strict=True):
                self.live[plan.request_ids[row]].output.append(tok)
            for done in out.finished:
                self.check_finished(self.live.pop(done.request_id), done)
        assert not self.core.has_unfinished(), "a request never finished"
        assert not self.live
        self.core.check_invariants()
        pool = self.core.stats()["pool"]
        assert pool["num_free_blocks"] == pool["num_blocks"]


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
