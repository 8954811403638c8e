"""The native CPU decoder: the whole forward of a step in one Rust call (`aieng._core.CpuDecoder`,
`rust/src/cpu_decoder/`), built once from the loaded torch model.

The decoder reads the torch model's own weights — float weights through numpy views of the same
storage (nothing copied, nothing released: the torch model stays the reference and the fallback),
quantized layers through the `Int8Weights` their CPU method already packed — and the options each
layer's modules carry (`AttentionOptions` as `layers/attention_block.py` built them: q/k norms per
head or across heads, layers without RoPE, biases, sliding windows, soft-capping), so it computes
what the torch model computes. Each step it writes the step's K/V into the runner's cache tensors
(shared with the torch path and the core's block pool) and returns the final hidden states and
the logits of the sampled rows.

`native_unsupported_reason` says why a model runs on the torch runner instead (MoE layers, a
quantized layer on a kernel other than int8/int8x2, tensor parallelism, an attention backend
other than `cpu`, ...). It writes and reads float32, bfloat16 and INT8 caches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from aieng import _core
from aieng.attention.backend import KVCache, QuantizedKVCache
from aieng.config.model_config import ModelConfig
from aieng.distributed.parallel_state import get_tp_world_size
from aieng.kernels.threads import kernel_threads
from aieng.layers.activation import gelu_tanh_and_mul, silu_and_mul
from aieng.layers.linear import DenseLinearMethod, Linear
from aieng.layers.norm import RMSNorm
from aieng.worker.step_plan import ForwardPlan

logger = logging.getLogger(__name__)

ACTIVATIONS = {silu_and_mul: "silu", gelu_tanh_and_mul: "gelu_tanh"}


class NativeUnsupported(ValueError):
    """The model has a part the native decoder does not cover; the message names it."""


def _floats(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a float32 or bfloat16 (as int16 bits) CPU tensor's storage."""
    tensor = tensor.detach()
    if tensor.dtype == torch.float32:
        return tensor.contiguous().numpy()
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy()
    raise NativeUnsupported(f"a weight in {tensor.dtype} (float32 and bfloat16 only)")


def _norm(module: nn.Module | None) -> np.ndarray | None:
    """A norm's effective float32 weight: w, or 1 + w for Gemma's unit-offset form."""
    if module is None:
        return None
    if type(module) is not RMSNorm:
        raise NativeUnsupported(f"a {type(module).__name__} norm (tensor-parallel q/k norm?)")
    weight = module.weight.detach().float()
    if module.unit_offset:
        weight = 1.0 + weight
    return weight.contiguous().numpy()


def _linear(layer: Linear) -> tuple[Any, np.ndarray | None, bool]:
    """(weight, bias, split) as the decoder takes a linear layer."""
    bias = None if layer.bias is None else layer.bias.detach().float().contiguous().numpy()
    method = layer.method
    if isinstance(method, DenseLinearMethod):
        return _floats(layer.weight), bias, False
    kernel = getattr(method, "kernel", None)
    packed = getattr(layer, "int8_weights", None)
    if kernel in ("int8", "int8x2") and packed is not None:
        return packed, bias, kernel == "int8x2"
    raise NativeUnsupported(f"{layer.prefix} runs the {kernel or type(method).__name__} kernel")


def _head(model: nn.Module) -> tuple[Any, np.ndarray | None, bool]:
    """The LM head as a linear: the tied table or the untied head, or their int8 copy."""
    tied = getattr(model, "tie_word_embeddings", False)
    module = model.model.embed_tokens if tied else model.lm_head
    packed = getattr(module, "int8_head", None)
    if packed is not None:  # cpu_lm_head=int8: multiplied with the int8x2 activations
        return packed, None, True
    if tied:
        return _floats(module.weight), None, False
    return _linear(module)


@dataclass(frozen=True)
class _Layer:
    spec: dict[str, Any]
    rotary: nn.Module | None


def _layer(layer: nn.Module, family: str) -> _Layer:
    attn = layer.self_attn
    mlp = layer.mlp_module if hasattr(layer, "mlp_name") else layer.mlp
    if not hasattr(mlp, "gate_up_proj"):
        raise NativeUnsupported(f"a {type(mlp).__name__} MLP (MoE layers)")
    spec: dict[str, Any] = {
        "qkv": _linear(attn.qkv_proj),
        "o": _linear(attn.o_proj),
        "gate_up": _linear(mlp.gate_up_proj),
        "down": _linear(mlp.down_proj),
        "window": attn.attn.sliding_window,
        "q_norm": _norm(getattr(attn, "q_norm", None)) if attn.has_qk_norm else None,
        "k_norm": _norm(getattr(attn, "k_norm", None)) if attn.has_qk_norm else None,
    }
    if family == "gemma":
        spec |= {
            "input_norm": _norm(layer.input_layernorm),
            "post_attention_norm": _norm(layer.post_attention_layernorm),
            "pre_feedforward_norm": _norm(layer.pre_feedforward_layernorm),
            "post_feedforward_norm": _norm(layer.post_feedforward_layernorm),
        }
    elif layer.post_norms:  # OLMo 2
        spec |= {
            "post_attention_norm": _norm(layer.post_attention_layernorm),
            "post_feedforward_norm": _norm(layer.post_feedforward_layernorm),
        }
    else:
        spec |= {
            "input_norm": _norm(layer.input_layernorm),
            "post_attention_norm": _norm(layer.post_attention_layernorm),
        }
    return _Layer(spec, attn.rotary)


def _family(model: nn.Module) -> str:
    from aieng.models.gemma import GemmaForCausalLM
    from aieng.models.llama import LlamaForCausalLM

    if type(model) is LlamaForCausalLM:
        return "llama"
    if type(model) is GemmaForCausalLM:
        return "gemma"
    raise NativeUnsupported(f"the {type(model).__name__} model class")


def _config(model: nn.Module, config: ModelConfig, family: str) -> dict[str, Any]:
    first = model.model.layers[0]
    attn = first.self_attn.attn
    mlp = first.mlp_module if family == "llama" else first.mlp
    activation = ACTIVATIONS.get(mlp.act_and_mul)
    if activation is None:
        raise NativeUnsupported(f"the activation {mlp.act_and_mul!r}")
    if family == "gemma":
        dtype = model.model.embed_tokens.weight.dtype
        embedding_scale = float(torch.tensor(model.model.normalizer, dtype=dtype))
        norms = "sandwich"
    else:
        embedding_scale = config.embedding_multiplier
        norms = "post" if config.post_norms else "pre"
    return {
        "hidden": config.hidden_size,
        "heads": attn.num_heads,
        "kv_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "intermediate": config.intermediate_size,
        "vocab": config.vocab_size,
        "eps": config.rms_norm_eps,
        "attention_scale": attn.scale,
        "attention_softcap": attn.logit_softcap,
        "final_softcap": config.final_logit_softcapping,
        "embedding_scale": embedding_scale,
        "residual_scale": config.residual_multiplier if family == "llama" else 1.0,
        "logits_scale": config.logits_scaling,
        "activation": activation,
        "norms": norms,
        "qk_norm_per_head": first.self_attn.norm_per_head,
    }


def native_unsupported_reason(
    model: nn.Module,
    config: ModelConfig,
    device: torch.device,
    attention_backend: str = "cpu",
) -> str | None:
    """Why the native decoder cannot run this model here, or None when it can. It attends with
    the `cpu` attention backend's kernel, so it runs only where that backend was chosen (and
    passed its start-up check)."""
    if device.type != "cpu":
        return f"it runs on the CPU only (device {device})"
    if attention_backend != "cpu":
        return f"the attention backend is {attention_backend!r}, not the Rust core's 'cpu'"
    if not hasattr(_core, "CpuDecoder"):
        return "the Rust core was built without it"
    if get_tp_world_size() != 1:
        return "tensor parallelism runs on the torch runner"
    if config.num_experts or config.moe_layers:
        return "MoE layers run on the torch runner"
    try:
        _family(model)
    except NativeUnsupported as error:
        return str(error)
    return None


class NativeDecoder:
    """The decoder built from `model`, and the step call the runner makes."""

    def __init__(self, model: nn.Module, config: ModelConfig):
        family = _family(model)
        layers = [_layer(layer, family) for layer in model.model.layers]
        rotaries: list[nn.Module] = []
        for layer in layers:
            if layer.rotary is not None and all(layer.rotary is not r for r in rotaries):
                rotaries.append(layer.rotary)
        specs = []
        for layer in layers:
            rope = None
            if layer.rotary is not None:
                rope = next(i for i, r in enumerate(rotaries) if r is layer.rotary)
            specs.append(layer.spec | {"rope": rope})
        ropes = [
            (r.cos.float().contiguous().numpy(), r.sin.float().contiguous().numpy())
            for r in rotaries
        ]
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.dtype = model.model.embed_tokens.weight.dtype
        self.decoder = _core.CpuDecoder(
            _config(model, config, family),
            _floats(model.model.embed_tokens.weight),
            specs,
            _norm(model.model.norm),
            _head(model),
            ropes,
        )
        self._caches: tuple[list[KVCache], Any] | None = None

    def _caches_for(self, kv_caches: list[KVCache]) -> Any:
        """The `CpuKvCaches` over this list of layer caches (built once per list)."""
        if self._caches is None or self._caches[0] is not kv_caches:
            layers = []
            for cache in kv_caches:
                if isinstance(cache, QuantizedKVCache):
                    tensors = (cache.k, cache.v, cache.k_scale, cache.v_scale)
                else:
                    tensors = tuple(cache)
                layers.append(tuple(_cache_array(t) for t in tensors))
            self._caches = (kv_caches, _core.CpuKvCaches(layers))
        return self._caches[1]

    def forward(
        self,
        plan: ForwardPlan,
        block_tables: np.ndarray,
        kv_caches: list[KVCache],
        logits_rows: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (final hidden states (T, hidden) in the model's dtype, logits (S, vocab) float32
        of `logits_rows`)."""
        rows = _int32(np.zeros(0, np.int32) if logits_rows is None else logits_rows)
        tokens = len(plan.input_ids)
        hidden = torch.empty(tokens, self.hidden_size, dtype=torch.float32)
        logits = torch.empty(len(rows), self.vocab_size, dtype=torch.float32)
        self.decoder.step(
            _int32(plan.input_ids),
            _int32(plan.positions),
            _int32(plan.slot_mapping),
            _int32(plan.query_start_loc),
            _int32(plan.seq_lens),
            np.ascontiguousarray(block_tables, np.int32),
            rows,
            self._caches_for(kv_caches),
            hidden.numpy(),
            logits.numpy(),
            kernel_threads(),
        )
        return (hidden if self.dtype == torch.float32 else hidden.to(self.dtype)), logits


def _int32(values: Any) -> np.ndarray:
    return np.ascontiguousarray(values, np.int32)


def _cache_array(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy()
    return tensor.numpy()


def native_decoder(
    mode: str,
    model: nn.Module,
    config: ModelConfig,
    device: torch.device,
    attention_backend: str,
) -> NativeDecoder | None:
    """The native decoder for `mode` (EngineArgs.cpu_native), or None (on the CPU, after one
    log line naming why)."""
    if mode == "off" or device.type != "cpu":
        return None
    reason = native_unsupported_reason(model, config, device, attention_backend)
    if reason is None:
        try:
            decoder = NativeDecoder(model, config)
        except NativeUnsupported as error:
            reason = str(error)
        else:
            logger.info("cpu native decoder: on (%s)", decoder.decoder)
            return decoder
    logger.info("cpu native decoder: off, the torch runner serves: %s", reason)
    return None
