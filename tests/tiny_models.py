"""Tiny random-weight Hugging Face checkpoints (float32) for tests, one per architecture."""

from pathlib import Path

import torch
import transformers

VOCAB_SIZE = 256
COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    # Wider than HF's 0.02 so that the top logits are well separated and greedy is unambiguous.
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=2,
)

ARCHITECTURES = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            rope_theta=500000.0,
        ),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=24),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True, num_key_value_heads=1),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=32),  # not hidden_size / num_heads (16)
    ),
}

# Mixture of experts, kept out of ARCHITECTURES (whose every entry each dense test runs): 8
# experts, top-2, weights not renormalised; layer 1 dense (mlp_only_layers); head_dim 32.
QWEN3_MOE = (
    transformers.Qwen3MoeConfig,
    transformers.Qwen3MoeForCausalLM,
    dict(
        num_hidden_layers=3,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[1],
    ),
)


def build_checkpoint(arch: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny `arch` model to `folder` (safetensors) and return the folder."""
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    return save_tiny(config_cls, model_cls, {**extra, **overrides}, folder, seed)


def save_tiny(config_cls, model_cls, overrides: dict, folder: Path, seed: int = 0) -> Path:
    """A random-weight float32 `model_cls` of COMMON's shape with `overrides`, norms and biases
    randomised, saved to `folder` (safetensors)."""
    config = config_cls(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _randomize_norms(model)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def load_hf(folder: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int):
    """-> (HF's greedy continuation of `prompt`, ignoring EOS, and its tokens' logprobs)."""
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def _randomize_norms(model: torch.nn.Module) -> None:
    # HF initialises RMSNorm weights to 1 and biases to 0; random values test that they are loaded.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
