"""The Hugging Face folder a training run exports: model.safetensors under the checkpoint's own
tensor names (the fused q/k/v and gate/up projections split back into q_proj, k_proj, v_proj,
gate_proj and up_proj), config.json and generation_config.json. transformers'
AutoModelForCausalLM and aieng load it unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Contiguous tensors under Hugging Face's names: every fused layer named in the model's
    `packed_modules` is split along its output dimension at its `output_sizes`; a tied LM head
    has no tensor of its own, as HF saves it."""
    shards_of: dict[str, list[tuple[str, int]]] = {}  # fused layer -> [(HF name, shard)]
    for hf_name, (fused, shard) in getattr(model, "packed_modules", {}).items():
        shards_of.setdefault(fused, []).append((hf_name, shard))
    state = {}
    for name, param in model.named_parameters():
        *path, leaf = name.split(".")
        tensor = param.detach()
        if not path or path[-1] not in shards_of:
            state[name] = tensor.contiguous()
            continue
        layer = model.get_submodule(".".join(path))
        pieces = tensor.split(layer.output_sizes, dim=getattr(param, "output_dim", 0))
        for hf_name, shard in shards_of[path[-1]]:
            state[".".join([*path[:-1], hf_name, leaf])] = pieces[shard].contiguous()
    return state


def export_checkpoint(
    out: Path,
    model: nn.Module,
    config_json: dict[str, Any],
    generation_config: dict[str, Any],
    dtype: str,
) -> None:
    """Writes the model's weights in `dtype` ("float32" or "bfloat16") and its configs to `out`;
    model.safetensors is replaced atomically."""
    from safetensors.torch import save_file

    tensors = {k: v.to(getattr(torch, dtype)) for k, v in hf_state_dict(model).items()}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates the file owner-only; a shipped model is readable
    os.replace(tmp, out / "model.safetensors")
    write_json(out / "config.json", {**config_json, "torch_dtype": dtype})
    write_json(out / "generation_config.json", generation_config)


POOLING_FOLDER = "1_Pooling"
_POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}


def write_pooling_files(out: Path, hidden_size: int, pooling: str, max_seq_length: int) -> None:
    """sentence-transformers' description of an embedding model beside the checkpoint:
    modules.json (Transformer, Pooling, Normalize), 1_Pooling/config.json (one pooling mode) and
    sentence_bert_config.json; aieng's `LLM.embed` and sentence-transformers both read them."""
    if pooling not in _POOLING_FLAGS:
        raise ValueError(f"pooling must be one of {', '.join(_POOLING_FLAGS)}, got {pooling!r}")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": POOLING_FOLDER,
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    flags = (
        "pooling_mode_cls_token",
        "pooling_mode_mean_tokens",
        "pooling_mode_max_tokens",
        "pooling_mode_mean_sqrt_len_tokens",
        "pooling_mode_weightedmean_tokens",
        "pooling_mode_lasttoken",
    )
    config = {
        "word_embedding_dimension": hidden_size,
        **{flag: flag == _POOLING_FLAGS[pooling] for flag in flags},
        "include_prompt": True,
    }
    (out / POOLING_FOLDER).mkdir(exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    write_json(out / "modules.json", modules)
    write_json(out / POOLING_FOLDER / "config.json", config)
    write_json(
        out / "sentence_bert_config.json",
        {"max_seq_length": max_seq_length, "do_lower_case": False},
    )


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
