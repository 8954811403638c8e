"""Granite, OLMo 2 and SmolLM3 — Llama-like families served by aieng's one Llama definition —
against Hugging Face transformers on tiny random checkpoints: greedy tokens identical and logprobs
within 1e-4, batched and with chunked prefill."""

import json

import pytest
import torch
import transformers
from hf_parity import (
    HFReference,
    as_our_parameter_names,
    check_batched,
    check_prefix_hit,
)
from tiny_models import save_tiny
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from aieng.config.model_config import ModelConfig
from aieng.layers.norm import RMSNorm

LENGTHS = [1, 5, 12, 17, 33]
GRANITE = dict(
    embedding_multiplier=3.0,
    residual_multiplier=0.6,
    attention_multiplier=0.4,  # not head_dim ** -0.5 (0.25)
    logits_scaling=0.8,
)

# name -> (config class, model class, overrides)
CHECKPOINTS = {
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM, GRANITE),
    "granite_bias": (
        transformers.GraniteConfig,
        transformers.GraniteForCausalLM,
        dict(GRANITE, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    ),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, {}),
    "olmo2_bias": (
        transformers.Olmo2Config,
        transformers.Olmo2ForCausalLM,
        dict(attention_bias=True, num_key_value_heads=4),
    ),
    # Every second layer without RoPE (layers 1 and 3).
    "smollm3_interval": (
        transformers.SmolLM3Config,
        transformers.SmolLM3ForCausalLM,
        dict(num_hidden_layers=4, no_rope_layer_interval=2, rope_theta=10000.0, pad_token_id=0),
    ),
    # An explicit list (1 = the layer uses RoPE), with biases.
    "smollm3_list": (
        transformers.SmolLM3Config,
        transformers.SmolLM3ForCausalLM,
        dict(
            num_hidden_layers=3,
            no_rope_layers=[0, 1, 0],
            attention_bias=True,
            mlp_bias=True,
            rope_theta=10000.0,
            pad_token_id=0,
        ),
    ),
}


def build(name, folder):
    return save_tiny(*CHECKPOINTS[name], folder)


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def reference(request, tmp_path_factory):
    folder = build(request.param, tmp_path_factory.mktemp(request.param))
    return HFReference(folder, LENGTHS, seed=5)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_llama_family_matches_hf(reference, chunk_size):
    check_batched(reference, chunk_size)


def test_llama_family_prefix_cache_hit_matches_hf(reference):
    check_prefix_hit(reference, shared_blocks=4, tail=reference.prompts[1])


def test_llama_family_parameters_are_hf_parameters(reference):
    expected = as_our_parameter_names(n for n, _ in reference.hf.named_parameters())
    ours = {n for n, p in reference.runner.model.named_parameters() if p is not None}
    assert ours == expected


BASE = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
)


def config(architecture, **extra):
    return ModelConfig.from_dicts({"architectures": [architecture], **BASE, **extra})


def test_llama_keeps_the_defaults():
    llama = config("LlamaForCausalLM", no_rope_layers=[0] * 8, embedding_multiplier=5.0)
    assert llama.no_rope_layers == () and llama.embedding_multiplier == 1.0
    assert llama.attention_scale is None and llama.logits_scaling == 1.0
    assert llama.residual_multiplier == 1.0
    assert not (llama.post_norms or llama.qk_norm_across_heads or llama.qk_norm)


def test_granite_multipliers_are_read():
    hf = transformers.GraniteConfig(**BASE, **GRANITE)
    granite = ModelConfig.from_dicts(
        {**json.loads(hf.to_json_string()), "architectures": ["GraniteForCausalLM"]}
    )
    assert granite.embedding_multiplier == 3.0 and granite.residual_multiplier == 0.6
    assert granite.attention_scale == 0.4 and granite.logits_scaling == 0.8


def test_olmo2_norms_are_post_norms_across_heads():
    olmo2 = config("Olmo2ForCausalLM", attention_bias=True, mlp_bias=True)
    assert olmo2.post_norms and olmo2.qk_norm_across_heads and not olmo2.qk_norm
    assert olmo2.norm_weight_in_float32
    assert olmo2.o_proj_bias and not olmo2.mlp_bias


@pytest.mark.parametrize(
    "extra, layers",
    [
        ({}, (3, 7)),  # HF's default interval, 4
        ({"no_rope_layer_interval": 3}, (2, 5)),
        ({"no_rope_layers": [1, 0, 1, 1, 0, 1, 1, 1]}, (1, 4)),
        ({"no_rope_layers": [1] * 8}, ()),
    ],
)
def test_smollm3_layers_without_rope(extra, layers):
    assert config("SmolLM3ForCausalLM", **extra).no_rope_layers == layers
    hf = transformers.SmolLM3Config(**BASE, **extra)
    assert tuple(i for i, uses in enumerate(hf.no_rope_layers) if not uses) == layers


@pytest.mark.parametrize(
    "no_rope_layers", [[1, 0], [1, 0, 1, 1, 0, 1, 1, 2], "all", [1, 0, 1, 1, 0, 1, 1, 0.5]]
)
def test_smollm3_bad_no_rope_layers_are_refused(no_rope_layers):
    with pytest.raises(ValueError, match=r"config\.json: field 'no_rope_layers' must be 8 entries"):
        config("SmolLM3ForCausalLM", no_rope_layers=no_rope_layers)


@pytest.mark.parametrize("name", ["attention_multiplier", "logits_scaling"])
def test_granite_nonpositive_scale_is_refused(name):
    with pytest.raises(ValueError, match=f"field '{name}' must be positive"):
        config("GraniteForCausalLM", **{name: 0.0})


@pytest.mark.parametrize("olmo2", [False, True])
def test_rms_norm_rounds_in_bfloat16_as_hf_does(olmo2):
    torch.manual_seed(0)
    hf = (Olmo2RMSNorm if olmo2 else LlamaRMSNorm)(64, eps=1e-6).to(torch.bfloat16)
    ours = RMSNorm(64, 1e-6, torch.bfloat16, weight_in_float32=olmo2)
    other = RMSNorm(64, 1e-6, torch.bfloat16, weight_in_float32=not olmo2)
    with torch.no_grad():
        hf.weight.uniform_(0.5, 1.5)
        ours.weight.copy_(hf.weight)
        other.weight.copy_(hf.weight)
    x = torch.randn(32, 64, dtype=torch.bfloat16) * 3
    assert torch.equal(ours(x), hf(x))
    assert not torch.equal(other(x), hf(x))  # the two roundings do differ
