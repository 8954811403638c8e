"""llama.cpp with continuous batching, through llama-cpp-python's low-level API (the peer of
benches/bench_cpu_peers.py's offline rows; benches/llama_cpp_peer.py loads and converts).

One context holds `slots` sequences, each with its own KV stream (`n_seq_max` = slots,
`kv_unified` off, `n_ctx` = slots x the longest request). Every step builds one `llama_batch`:
first the last token of every running sequence (one row of logits each), then chunks of waiting
prompts up to `n_batch` tokens (logits for a prompt's last token only) — the schedule of
llama.cpp's own `parallel` example. A finished sequence's slot is emptied
(`llama_memory_seq_rm`) and given to the next request. Tokens are greedy (argmax of the row,
the lowest id on a tie, as llama.cpp's greedy sampler picks), end-of-sequence ignored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Slot:
    request: int
    prompt: list[int]
    wanted: int
    fed: int = 0  # prompt tokens already in the KV cache
    output: list[int] = field(default_factory=list)

    @property
    def position(self) -> int:  # the next token's position in its sequence
        return self.fed + max(len(self.output) - 1, 0)


class BatchedLlama:
    """A llama.cpp model and a context of `slots` KV streams of `per_seq` tokens each."""

    def __init__(self, gguf: Path, threads: int, slots: int, per_seq: int, n_batch: int = 1024):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(
            str(gguf).encode(), lc.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = lc.llama_context_default_params()
        params.n_seq_max = slots
        params.n_ctx = slots * per_seq
        params.n_batch = n_batch
        params.n_ubatch = min(n_batch, 512)
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not make a context of {slots} x {per_seq} tokens")
        self.slots, self.per_seq, self.n_batch = slots, per_seq, n_batch
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.memory = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        if self.ctx:
            self.lc.llama_batch_free(self.batch)
            self.lc.llama_free(self.ctx)
            self.lc.llama_model_free(self.model)
            self.ctx = self.model = None

    def _argmax(self, row: int) -> int:
        logits = self.lc.llama_get_logits_ith(self.ctx, row)
        return int(np.ctypeslib.as_array(logits, shape=(self.vocab,)).argmax())

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        """Greedy tokens of every request, `output_lens[i]` of request i, continuously batched."""
        for prompt, wanted in zip(prompts, output_lens, strict=True):
            if not prompt or wanted < 1 or len(prompt) + wanted > self.per_seq:
                raise ValueError(
                    f"a request of {len(prompt)} prompt + {wanted} output tokens does not fit "
                    f"a slot of {self.per_seq}"
                )
        lc, batch = self.lc, self.batch
        waiting = list(range(len(prompts)))[::-1]
        running: dict[int, Slot] = {}  # slot (sequence id) -> its request
        results: list[list[int]] = [[] for _ in prompts]
        while waiting or running:
            for seq in range(self.slots):
                if seq not in running and waiting:
                    request = waiting.pop()
                    lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
                    running[seq] = Slot(request, prompts[request], output_lens[request])
            n, rows = 0, []  # rows: (batch row, slot) whose logits give a token
            for seq, slot in running.items():  # decoding sequences first: one token each
                if slot.output:
                    self._add(n, slot.output[-1], slot.position, seq, True)
                    rows.append((n, seq))
                    n += 1
            for seq, slot in running.items():  # then prompt chunks in the room left
                take = min(len(slot.prompt) - slot.fed, self.n_batch - n)
                if slot.output or take <= 0:
                    continue
                for j in range(take):
                    last = slot.fed + j == len(slot.prompt) - 1
                    self._add(n, slot.prompt[slot.fed + j], slot.fed + j, seq, last)
                    if last:
                        rows.append((n, seq))
                    n += 1
                slot.fed += take
            batch.n_tokens = n
            status = lc.llama_decode(self.ctx, batch)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status} on a batch of {n} tokens")
            for row, seq in rows:
                slot = running[seq]
                slot.output.append(self._argmax(row))
                if len(slot.output) == slot.wanted:
                    results[slot.request] = slot.output
                    del running[seq]
        return results

    def _add(self, i: int, token: int, position: int, seq: int, logits: bool) -> None:
        batch = self.batch
        batch.token[i] = token
        batch.pos[i] = position
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = int(logits)


def run_batched(
    gguf: Path, prompts: list[list[int]], output_lens: list[int], threads: int, slots: int
) -> dict:
    """Every request through `slots` continuously batched sequences -> output tokens/s and each
    request's tokens (a warm-up request first, outside the timing)."""
    per_seq = -(-max(len(p) + n for p, n in zip(prompts, output_lens, strict=True)) // 256) * 256
    engine = BatchedLlama(gguf, threads, slots, per_seq)
    try:
        engine.generate([prompts[0][:8]], [4])
        start = time.perf_counter()
        token_ids = engine.generate(prompts, output_lens)
        wall = time.perf_counter() - start
    finally:
        engine.close()
    tokens = sum(map(len, token_ids))
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "token_ids": token_ids}
