"""The runner's persistent inputs: device tensors written in place each step (what a CUDA graph
replays over), staged through pinned host memory on CUDA, and the block table of every slot.

The core hands over only the blocks that are new to a slot (`new_block_slots`, `new_block_indices`,
`new_block_ids`); the table keeps the rest from earlier steps.
"""

from __future__ import annotations

import numpy as np
import torch


class InputBuffers:
    def __init__(self, max_tokens: int, max_blocks_per_seq: int, device: torch.device):
        self.device = device
        self.max_tokens = max_tokens
        pin = device.type == "cuda"
        self._host = torch.zeros((3, max_tokens), dtype=torch.int64, pin_memory=pin)
        self._device = torch.zeros((3, max_tokens), dtype=torch.int64, device=device)
        self.block_table = np.zeros((0, max_blocks_per_seq), np.int32)  # (slots, blocks)

    def apply_new_blocks(self, slots: np.ndarray, indices: np.ndarray, ids: np.ndarray) -> None:
        if len(slots) == 0:
            return
        needed = int(slots.max()) + 1
        if needed > len(self.block_table):
            grown = np.zeros(
                (max(needed, 2 * len(self.block_table), 64), self.block_table.shape[1]), np.int32
            )
            grown[: len(self.block_table)] = self.block_table
            self.block_table = grown
        self.block_table[slots, indices] = ids

    def block_tables(self, slots: np.ndarray, width: int) -> np.ndarray:
        """(R, width) block ids of the step's requests."""
        return self.block_table[slots, :width]

    def write(
        self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> device views (T,) int64 of the step's input ids, positions and cache slots."""
        n = len(input_ids)
        if n > self.max_tokens:  # a one-off larger forward (scoring, profiling)
            arrays = (input_ids, positions, slot_mapping)
            return tuple(  # type: ignore[return-value]
                torch.from_numpy(np.asarray(a, np.int64)).to(self.device) for a in arrays
            )
        host = self._host[:, :n]
        for row, array in enumerate((input_ids, positions, slot_mapping)):
            host[row].copy_(torch.from_numpy(array))
        if self._device.device.type == "cpu":
            out = host
        else:
            out = self._device[:, :n]
            out.copy_(host, non_blocking=True)
        return out[0], out[1], out[2]
