"""YaRN, dynamic-NTK and LongRoPE scaling, Llama's attention/MLP biases and the refusals of
unsupported checkpoints, against Hugging Face transformers on tiny random checkpoints."""

import json

import pytest
import torch
import transformers
from hf_parity import (
    BLOCK_SIZE,
    HFReference,
    as_our_parameter_names,
    check_batched,
    check_prefix_hit,
)
from tiny_models import build_checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from aieng.config.engine_args import EngineArgs
from aieng.config.model_config import ModelConfig
from aieng.layers.rotary import rope_inv_freq
from aieng.models.registry import MODEL_CLASSES

ORIGINAL = 16  # original_max_position_embeddings of the scaled checkpoints
HALF = 8  # head_dim / 2 of the tiny checkpoints (hidden 64, 4 heads)
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
    "long_factor": [1.0 + 0.7 * i for i in range(HALF)],
    "original_max_position_embeddings": ORIGINAL,
}

# name -> (tiny_models architecture, overrides, prompt lengths)
CHECKPOINTS = {
    "llama_yarn": (
        "llama",
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
                "beta_fast": 16,
                "beta_slow": 1,
            },
            rope_theta=10000.0,
        ),
        [1, 5, 12, 17, 25, 40],
    ),
    "llama_yarn_mscale": (
        "llama",
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": ORIGINAL,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
                "truncate": False,
            },
            rope_theta=10000.0,
        ),
        [3, 17, 33, 40],
    ),
    "qwen2_yarn": (
        "qwen2",
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
            }
        ),
        [2, 9, 17, 26, 40],
    ),
    # transformers rescales the base only past max_position_embeddings (48 here), which aieng
    # does not serve; prompts + outputs reach position 47.
    "llama_dynamic": (
        "llama",
        dict(
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
            rope_theta=10000.0,
            max_position_embeddings=48,
        ),
        [1, 7, 17, 33, 40],
    ),
    # Prompts within the original context whose continuations cross it: the short factors up to
    # it, the long ones past it (transformers' choice per decode step; aieng's per position).
    "llama_longrope": ("llama", dict(rope_scaling=LONGROPE, rope_theta=10000.0), [1, 9, 12, 15]),
    "llama_bias": ("llama", dict(attention_bias=True, mlp_bias=True), [1, 7, 17, 33, 40]),
    "qwen3_attention_bias": ("qwen3", dict(attention_bias=True), [4, 17, 40]),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def reference(request, tmp_path_factory):
    arch, overrides, lengths = CHECKPOINTS[request.param]
    folder = build_checkpoint(arch, tmp_path_factory.mktemp(request.param), **overrides)
    return HFReference(folder, lengths, seed=3)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_scaled_rope_and_bias_models_match_hf(reference, chunk_size):
    check_batched(reference, chunk_size)


def test_scaled_rope_prefix_cache_hit_matches_hf(reference):
    # 5 blocks: 20 tokens of the 40-token prompt, past the scaled checkpoints' original context
    # (3 blocks of the longrope checkpoint's 15-token prompt)
    shared = min(5, len(reference.prompts[-1]) // BLOCK_SIZE)
    check_prefix_hit(reference, shared_blocks=shared, tail=reference.prompts[0])


def test_bias_parameters_are_created_where_hf_has_them(reference):
    model = reference.runner.model
    hf_names = {n for n, _ in reference.hf.named_parameters() if n.endswith(".bias")}
    ours = {n for n, p in model.named_parameters() if n.endswith(".bias") and p is not None}
    assert ours == as_our_parameter_names(hf_names)


BASE = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    rope_theta=10000.0,
)


@pytest.mark.parametrize(
    "scaling, seq_len",
    [
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, None),
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "mscale": 0.7,
                "mscale_all_dim": 1.0,
                "beta_fast": 16,
                "beta_slow": 2,
            },
            None,
        ),
        (
            {
                "rope_type": "yarn",
                "factor": 3.0,
                "original_max_position_embeddings": 64,
                "truncate": False,
            },
            None,
        ),
        ({"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3}, None),
        ({"rope_type": "dynamic", "factor": 2.0}, None),
        ({"rope_type": "dynamic", "factor": 1.1}, None),
        ({**LONGROPE, "original_max_position_embeddings": 32}, 33),
        ({**LONGROPE, "original_max_position_embeddings": 32, "factor": 2.0}, 33),
        ({**LONGROPE, "original_max_position_embeddings": 256}, None),
    ],
)
def test_rope_frequencies_and_attention_factor_match_transformers(scaling, seq_len):
    hf_config = transformers.LlamaConfig(**BASE, rope_scaling=dict(scaling))
    expected, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](
        hf_config, "cpu", seq_len=seq_len
    )
    ours = ModelConfig.from_dicts(
        {"architectures": ["LlamaForCausalLM"], **json.loads(hf_config.to_json_string())}
    )
    assert torch.equal(rope_inv_freq(ours.head_dim, ours.rope), expected)
    assert ours.rope.attention_factor == attention_factor


def test_phi3_style_top_level_original_context_takes_priority():
    raw = {
        "architectures": ["LlamaForCausalLM"],
        **BASE,
        "original_max_position_embeddings": 64,
        "rope_scaling": {**LONGROPE, "original_max_position_embeddings": 999},
    }
    rope = ModelConfig.from_dicts(raw).rope
    assert rope.original_max_position_embeddings == 64 and rope.use_long_factor


def test_dynamic_context_is_capped_at_max_position_embeddings():
    # Past max_position_embeddings transformers changes the base per forward pass; aieng refuses.
    with pytest.raises(ValueError, match="exceeds the model's context"):
        EngineArgs(model="x", max_model_len=49).effective_max_model_len(48)


def test_biases_follow_each_architecture():
    def config(arch, **extra):
        return ModelConfig.from_dicts({"architectures": [arch], **BASE, **extra})

    llama = config("LlamaForCausalLM", attention_bias=True, mlp_bias=True)
    assert llama.attention_bias and llama.o_proj_bias and llama.mlp_bias
    qwen2 = config("Qwen2ForCausalLM")
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.mlp_bias
    qwen3 = config("Qwen3ForCausalLM", attention_bias=True, mlp_bias=True)
    assert qwen3.attention_bias and qwen3.o_proj_bias and not qwen3.mlp_bias
    mistral = config("MistralForCausalLM", attention_bias=True, mlp_bias=True)
    assert not (mistral.attention_bias or mistral.o_proj_bias or mistral.mlp_bias)


SUPPORTED = ", ".join(sorted(MODEL_CLASSES))


@pytest.mark.parametrize(
    "hf_config, architecture",
    [
        (transformers.GPT2Config(), "GPT2LMHeadModel"),
        (transformers.GPTNeoXConfig(), "GPTNeoXForCausalLM"),
        (transformers.FalconConfig(), "FalconForCausalLM"),
    ],
)
def test_unsupported_architecture_is_refused_before_any_field(tmp_path, hf_config, architecture):
    raw = {**json.loads(hf_config.to_json_string()), "architectures": [architecture]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    message = f"architecture '{architecture}' is not supported (supported: {SUPPORTED})"
    for supported in ("LlamaForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        assert supported in message
    with pytest.raises(ValueError, match=r"config\.json") as error:
        ModelConfig.from_pretrained(tmp_path)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_act": "gelu"}, "field 'hidden_act' = 'gelu' is not supported"),
        (
            {"rope_scaling": {"rope_type": "mrope", "factor": 2.0}},
            "field 'rope_scaling.rope_type' = 'mrope' is not supported",
        ),
        ({"partial_rotary_factor": 0.5}, "field 'partial_rotary_factor' = 0.5 is not supported"),
        ({"use_sliding_window": True}, "field 'use_sliding_window' = true is not supported"),
        (
            {"rope_scaling": {**LONGROPE, "short_factor": [1.0, 2.0]}},
            "field 'short_factor' must be 8 positive numbers",
        ),
    ],
)
def test_unsupported_option_is_named_with_its_value(change, message):
    with pytest.raises(ValueError, match=r"config\.json") as error:
        ModelConfig.from_dicts({"architectures": ["LlamaForCausalLM"], **BASE, **change})
    assert message in str(error.value)
