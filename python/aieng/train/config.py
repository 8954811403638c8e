"""The settings of a training run (`aieng train`'s options); no torch import, so the CLI's
parser builds fast."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aieng.train.model_shape import ModelShape

OBJECTIVES = ("causal", "contrastive")
CONTRASTIVE_POOLING = ("mean", "last")
# What `--resume` may change; every other setting comes from the saved run.
RESUMABLE_OPTIONS = ("steps", "eval_interval", "checkpoint_interval", "log_interval", "threads")


@dataclass
class TrainConfig:
    data: str
    out: str
    heldout: str | None = None  # a held-out text file; else `heldout_fraction` of the documents
    heldout_fraction: float = 0.05
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 704
    seq_len: int = 512
    batch_size: int = 16
    steps: int = 1000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_interval: int = 200
    eval_windows: int = 64
    checkpoint_interval: int = 200
    log_interval: int = 10
    threads: int = 0  # torch threads; 0 = all cores
    save_dtype: str = "float32"  # or bfloat16: halves the file
    tokenizer: str | None = None  # a tokenizer.json to reuse instead of training one
    objective: str = "causal"  # or contrastive: a bi-encoder (see aieng.train.contrastive)
    init_from: str | None = None  # a Llama checkpoint folder: its shape, tokenizer and weights
    # contrastive only
    pooling: str = "mean"  # how a text's final hidden states become its embedding
    temperature: float = 0.05  # InfoNCE's softmax temperature (fixed)
    pair_window: int = 3  # verses (lines) in a passage: the window holding the query's verse
    query_drop: float = 0.3  # each word of the query's verse dropped with this probability
    hard_negatives: bool = True  # one more passage per pair: another window of its chapter

    def shape(self, vocab_size: int) -> ModelShape:
        return ModelShape(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.seq_len,
        )

    def validate(self) -> None:
        positive = ("vocab_size", "seq_len", "batch_size", "steps", "eval_windows", "log_interval")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if not 0 < self.lr < 1:
            raise ValueError(f"--lr {self.lr} must be in (0, 1)")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError("--heldout-fraction must be in [0, 1)")
        if self.save_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--save-dtype must be float32 or bfloat16, got {self.save_dtype}")
        if self.tokenizer is not None and not Path(self.tokenizer).is_file():
            raise ValueError(f"--tokenizer {self.tokenizer}: no such file")
        if self.tokenizer is not None and self.init_from is not None:
            raise ValueError("--tokenizer and --init-from both name a tokenizer: give one")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--objective must be one of {', '.join(OBJECTIVES)}")
        if self.pooling not in CONTRASTIVE_POOLING:
            raise ValueError(f"--pooling must be one of {', '.join(CONTRASTIVE_POOLING)}")
        if not 0 < self.temperature <= 1:
            raise ValueError(f"--temperature {self.temperature} must be in (0, 1]")
        if self.pair_window <= 0:
            raise ValueError("--pair-window must be positive")
        if not 0 <= self.query_drop < 1:
            raise ValueError(f"--query-drop {self.query_drop} must be in [0, 1)")
        self.shape(self.vocab_size).validate()
