"""The logits matmul on the CPU: the LM head (tied to the embedding table, as most small models
have it, or untied and dense) read by aieng's kernels.

- `dense`: the float head through the dense GEMV for decode-sized batches (`aieng.kernels.
  cpu_dense`), torch's matmul otherwise;
- `int8`: an 8-bit copy of the head (symmetric, one scale per 32 values, 1.125 bytes a weight
  against float32's 4) multiplied by the int8x2 kernel (activations to ~15 bits), so the head's
  error is the weights' 8-bit rounding alone. The embedding lookup keeps reading the float rows.

Either is checked once against float32 F.linear at load and steps aside with a warning naming
it when it disagrees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aieng.config.engine_args import CPU_LM_HEADS
from aieng.kernels.cpu_dense import passes_dense_check
from aieng.kernels.cpu_int8 import cpu_int8_available, int8_matmul, pack_int8_weights
from aieng.kernels.self_check import passes_check

INT8_HEAD_GROUP = 32
# Relative error of the 8-bit head's logits against float32 beyond which it steps aside: the
# weights' rounding gives ~3e-3 on random inputs.
INT8_HEAD_TOLERANCE = 1e-2


def head_module(model: nn.Module) -> nn.Module | None:
    """The module whose `weight` the logits read: the embedding table of a tied model, else the
    dense LM head; None when the head is quantized or not there."""
    if getattr(model, "tie_word_embeddings", False):
        return model.get_submodule("model.embed_tokens")
    head = getattr(model, "lm_head", None)
    return head if isinstance(getattr(head, "weight", None), torch.Tensor) else None


def quantize_rows_int8(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """weight (N, K) -> (q (N, K) in [1, 255], scales (N, G), zeros (N, G) = 128): symmetric
    8-bit per group (per row when K is not a multiple of `group`)."""
    n, k = weight.shape
    group = group if k % group == 0 else k
    w = weight.detach().float().view(n, k // group, group)
    scales = w.abs().amax(-1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[..., None]).clamp(-127, 127) + 128
    return q.view(n, k).to(torch.uint8), scales, torch.full_like(scales, 128.0)


def prepare_cpu_lm_head(model: nn.Module, mode: str) -> str:
    """Sets the head module's kernel for `mode` (one of CPU_LM_HEADS) -> what it runs: "int8",
    "dense_gemv" or "torch"."""
    if mode not in CPU_LM_HEADS:
        raise ValueError(f"cpu_lm_head must be one of {', '.join(CPU_LM_HEADS)}, got {mode!r}")
    head = head_module(model)
    if head is None or head.weight.device.type != "cpu":
        return "torch"
    weight = head.weight
    if mode == "int8" and cpu_int8_available():
        packed = pack_int8_weights(*quantize_rows_int8(weight, INT8_HEAD_GROUP), 8)
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
        if passes_check(
            "int8 LM head",
            lambda: int8_matmul(x, packed, split=True),
            lambda: F.linear(x, weight.detach().float()),
            INT8_HEAD_TOLERANCE,
            "lm_head",
        ):
            head.int8_head = packed
            return "int8"
    if getattr(head, "method", None) is None and passes_dense_check(weight, "lm_head"):
        head.gemv = True  # the tied table (an untied dense head's method has its own check)
        return "dense_gemv"
    return "torch"
