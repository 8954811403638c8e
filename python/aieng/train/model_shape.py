"""The size and hyperparameters of a trainable Llama, and the config.json they become."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class ModelShape:
    vocab_size: int
    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 704
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden size {self.hidden_size} is not a multiple of "
                f"{self.num_attention_heads} heads"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.num_attention_heads} heads is not a multiple of "
                f"{self.num_key_value_heads} KV heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    def hf_config(self, bos_token_id: int, eos_token_id: int) -> dict:
        fields = asdict(self)
        fields.pop("initializer_range")
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **fields,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": self.initializer_range,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "torch_dtype": "float32",
            "use_cache": True,
        }
