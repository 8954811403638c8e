"""The peer of bench_core.py: the same step written in plain Python, nano-vllm style.

A block manager with hashed full blocks and ref counts, a FCFS scheduler with a
token budget, and a plan built as Python lists turned into numpy arrays. It rebuilds a dense
block table every step where the core hands over only the blocks that changed. It exists
only to measure what the Rust core saves per step; the engine never uses it.
"""

from collections import deque

import numpy as np


class PyBlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.hash_of: dict[int, int] = {}
        self.block_of: dict[int, int] = {}

    def allocate(self, seq: "PySeq") -> None:
        bs, h = self.block_size, -1
        for i in range(len(seq.tokens) // bs):
            h = hash((h, tuple(seq.tokens[i * bs : (i + 1) * bs])))
            block = self.block_of.get(h)
            if block is None or (self.ref[block] == 0 and block not in self.free):
                break
            if self.ref[block] == 0:
                self.free.remove(block)
            self.ref[block] += 1
            seq.blocks.append(block)
            seq.cached += bs
        seq.computed = min(seq.cached, len(seq.tokens) - 1)

    def grow(self, seq: "PySeq", slots: int) -> bool:
        need = -(-slots // self.block_size) - len(seq.blocks)
        if need > len(self.free):
            return False
        for _ in range(max(need, 0)):
            block = self.free.popleft()
            old = self.hash_of.pop(block, None)
            if old is not None:
                self.block_of.pop(old, None)
            self.ref[block] = 1
            seq.blocks.append(block)
        return True

    def release(self, seq: "PySeq") -> None:
        for block in reversed(seq.blocks):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free.append(block)
        seq.blocks = []


class PySeq:
    def __init__(self, rid: str, slot: int, tokens: list[int], max_tokens: int):
        self.rid, self.slot, self.tokens, self.max_tokens = rid, slot, list(tokens), max_tokens
        self.prompt_len = len(tokens)
        self.blocks: list[int] = []
        self.computed = 0
        self.cached = 0


class PyScheduler:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, budget: int):
        self.bm = PyBlockManager(num_blocks, block_size)
        self.max_num_seqs, self.budget = max_num_seqs, budget
        self.waiting: deque[PySeq] = deque()
        self.running: list[PySeq] = []
        self.last: list[tuple[PySeq, int]] = []

    def add(self, rid: str, tokens: list[int], max_tokens: int) -> None:
        self.waiting.append(PySeq(rid, len(self.waiting) + len(self.running), tokens, max_tokens))

    def schedule(self) -> dict[str, np.ndarray]:
        budget, step = self.budget, []
        for seq in list(self.running):
            n = min(len(seq.tokens) - seq.computed, budget)
            if n and self.bm.grow(seq, seq.computed + n):
                step.append((seq, n))
                budget -= n
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self.bm.allocate(seq)
            n = min(len(seq.tokens) - seq.computed, budget)
            if not self.bm.grow(seq, seq.computed + n):
                self.bm.release(seq)
                break
            self.waiting.popleft()
            self.running.append(seq)
            step.append((seq, n))
            budget -= n
        bs = self.bm.block_size
        ids, pos, slots, qsl, computed, lens, logits, sample_rows = [], [], [], [0], [], [], [], []
        width = max((len(s.blocks) for s, _ in step), default=0)
        tables = np.zeros((len(step), width), dtype=np.int32)
        for row, (seq, n) in enumerate(step):
            start = seq.computed
            ids.extend(seq.tokens[start : start + n])
            for p in range(start, start + n):
                pos.append(p)
                slots.append(seq.blocks[p // bs] * bs + p % bs)
            qsl.append(len(ids))
            computed.append(start)
            lens.append(start + n)
            tables[row, : len(seq.blocks)] = seq.blocks
            if start + n == len(seq.tokens):
                logits.append(len(ids) - 1)
                sample_rows.append(row)
        self.last = step
        return {
            "input_ids": np.array(ids, dtype=np.int32),
            "positions": np.array(pos, dtype=np.int32),
            "slot_mapping": np.array(slots, dtype=np.int32),
            "query_start_loc": np.array(qsl, dtype=np.int32),
            "num_computed_tokens": np.array(computed, dtype=np.int32),
            "seq_lens": np.array(lens, dtype=np.int32),
            "block_tables": tables,
            "logits_indices": np.array(logits, dtype=np.int32),
            "sample_request_rows": np.array(sample_rows, dtype=np.int32),
            "slots": np.array([seq.slot for seq, _ in step], dtype=np.int32),
        }

    def update(self, sampled: np.ndarray) -> list[str]:
        finished, k = [], 0
        bs = self.bm.block_size
        for seq, n in self.last:
            seq.computed += n
            if seq.computed < len(seq.tokens):
                continue
            seq.tokens.append(int(sampled[k]))
            k += 1
            full = seq.computed // bs
            if full and seq.computed % bs == 0:
                block = seq.blocks[full - 1]
                h = hash((len(seq.tokens), tuple(seq.tokens[(full - 1) * bs : full * bs])))
                self.bm.hash_of[block] = h
                self.bm.block_of[h] = block
            if len(seq.tokens) - seq.prompt_len >= seq.max_tokens:
                self.bm.release(seq)
                self.running.remove(seq)
                finished.append(seq.rid)
        return finished

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)
