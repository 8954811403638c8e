"""A sparse mixture-of-experts MLP (Shazeer et al., 2017; Mixtral, Jiang et al., 2024; Qwen3-MoE):
a router scores every expert for each token, the `top_k` best are run, and their outputs are
summed weighted by the router's (optionally renormalised) softmax probabilities.

Each expert is a SwiGLU MLP built from `Linear` layers, so any linear method (dense, INT4) holds
its weights and the checkpoint's per-expert tensors load through the usual weight loaders
(`experts.{e}.gate_proj` + `up_proj` fused into `gate_up_proj`; Mixtral's `w1` + `w3` into
`w13`). The layer is batched over tokens: the step's (token, choice) pairs are sorted by expert
once, and each chosen expert multiplies all of its tokens in one call — a Python loop over the
experts that received tokens, never over tokens.

Routing is deterministic and batch-invariant: the router logits are computed per token in
float64 (so that a row's logits do not depend on how many other rows the matrix product holds)
and rounded to the model's dtype as transformers computes them; ties between equal
probabilities go to the lower expert index (a stable sort, where `torch.topk` promises no
order). Each token's chosen outputs are then added in ascending expert order, the order
transformers adds them in. A request's routing — and so its greedy output — is the same alone
or inside any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from aieng.distributed.parallel_state import get_tp_world_size, tp_all_reduce
from aieng.layers.activation import silu_and_mul
from aieng.layers.linear import Linear, LinearMethodChooser
from aieng.layers.parallel import column_parallel, row_parallel


@dataclass(frozen=True)
class ExpertNames:
    """The checkpoint's names inside one expert: Qwen3-MoE's `gate_proj`/`up_proj`/`down_proj`
    (fused here as `gate_up_proj`), Mixtral's `w1`/`w3`/`w2` (fused as `w13`); and the config
    field of an expert's intermediate size (named in tensor-parallel errors)."""

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    size_field: str = "moe_intermediate_size"


MIXTRAL_EXPERT_NAMES = ExpertNames(gate_up="w13", down="w2", size_field="intermediate_size")


class Expert(nn.Module):
    """One expert: down(silu(gate(x)) * up(x))."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        methods: LinearMethodChooser,
        prefix: str,
        names: ExpertNames,
    ):
        super().__init__()
        self.names = names
        sizes = [intermediate_size, intermediate_size]
        gate_up = Linear(
            hidden_size,
            sizes,
            False,
            dtype,
            methods,
            f"{prefix}.{names.gate_up}",
            column_parallel(hidden_size, sizes, names.size_field),
        )
        # Partial sums: the MoE layer all-reduces once, after combining the experts.
        down = Linear(
            intermediate_size,
            hidden_size,
            False,
            dtype,
            methods,
            f"{prefix}.{names.down}",
            row_parallel(intermediate_size, [hidden_size], names.size_field, reduce=False),
        )
        self.add_module(names.gate_up, gate_up)
        self.add_module(names.down, down)
        self._gate_up, self._down = gate_up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._down(silu_and_mul(self._gate_up(x)))


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits (T, E) -> (weights (T, k) float32, expert ids (T, k) int64), best first.
    Probabilities are a float32 softmax; equal probabilities rank by lower expert index."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    ranked, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = ranked[:, :top_k], order[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoE(nn.Module):
    """The MoE MLP of one decoder layer. `gate` is the router (dense: E x hidden)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        dtype: torch.dtype,
        methods: LinearMethodChooser,
        prefix: str,
        names: ExpertNames = ExpertNames(),
        weights_in_model_dtype: bool = True,
    ):
        super().__init__()
        self.tp_size = get_tp_world_size()  # the group its experts were cut for
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        # Qwen3-MoE casts the routing weights to the model's dtype before scaling the experts'
        # outputs; Mixtral scales in float32 and casts the product.
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
        self.experts = nn.ModuleList(
            Expert(hidden_size, intermediate_size, dtype, methods, f"{prefix}.experts.{e}", names)
            for e in range(num_experts)
        )

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, E) in x's dtype, each row independent of the others (float64
        product, then rounded)."""
        return F.linear(x.double(), self.gate.weight.double()).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden)."""
        num_tokens = x.shape[0]
        if num_tokens == 0:
            return torch.zeros_like(x)
        weights, ids = route(self.router_logits(x), self.top_k, self.renormalize)
        # Each token's choices in ascending expert order: the order their outputs are added in.
        ids, perm = torch.sort(ids, dim=-1)
        weights = weights.gather(1, perm)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        flat_ids = ids.flatten()  # (T * k,) pair p is token p // k, choice p % k
        order = torch.argsort(flat_ids, stable=True)  # the pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        inputs = x[order // self.top_k]  # (T * k, hidden), grouped by expert
        outputs = torch.empty_like(inputs)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                outputs[start:end] = self.experts[expert](inputs[start:end])
                start = end
        scale = weights.flatten()[order, None]
        if self.weights_in_model_dtype:
            scaled = outputs * scale
        else:
            scaled = (outputs * scale).to(x.dtype)
        per_choice = torch.empty_like(scaled)
        per_choice[order] = scaled  # back to (token, choice) order
        per_choice = per_choice.view(num_tokens, self.top_k, -1)
        out = per_choice[:, 0]
        for choice in range(1, self.top_k):  # ascending expert order, as transformers sums
            out = out + per_choice[:, choice]
        return tp_all_reduce(out, self.tp_size)
