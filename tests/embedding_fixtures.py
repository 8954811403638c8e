"""Tiny random sentence-transformers checkpoints (float32) for the embedding tests: a BERT and an
XLM-RoBERTa encoder with mean and CLS pooling, and a Qwen3 decoder with last-token pooling, each
saved by sentence-transformers itself (modules.json, 1_Pooling/, 2_Normalize/)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from text_fixtures import byte_level_bpe, save_model_dir
from tiny_models import COMMON

VOCAB = 384
ENCODER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=130,
    initializer_range=0.15,
)
# architecture -> (config class, model class, config overrides, pad token, pooling mode)
EMBEDDERS = {
    "bert": (transformers.BertConfig, transformers.BertModel, dict(ENCODER), "<unk>", "mean"),
    "xlm-roberta": (
        transformers.XLMRobertaConfig,
        transformers.XLMRobertaModel,
        dict(ENCODER, pad_token_id=1, type_vocab_size=1, hidden_act="gelu_new"),
        "<s>",
        "cls",
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(COMMON, vocab_size=VOCAB, head_dim=32, tie_word_embeddings=True),
        "<unk>",
        "lasttoken",
    ),
}


def save_hf_model(kind: str, folder: Path, seed: int = 0) -> Path:
    """The bare Hugging Face checkpoint (no sentence-transformers files) with its tokenizer."""
    config_cls, model_cls, overrides, pad, _ = EMBEDDERS[kind]
    save_model_dir(folder, byte_level_bpe(VOCAB), chat_template=None)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["pad_token"] = pad
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    torch.manual_seed(seed)
    model = model_cls(config_cls(**overrides)).to(torch.float32).eval()
    with torch.no_grad():  # LayerNorm/RMSNorm weights and biases away from 1 and 0
        for name, param in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.uniform_(-0.2, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def save_sentence_transformer(kind: str, folder: Path, seed: int = 0) -> Path:
    """A sentence-transformers model folder over `kind`'s tiny checkpoint: Transformer ->
    Pooling (the kind's mode) -> Normalize, saved by sentence-transformers."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    hf = save_hf_model(kind, folder / "hf", seed)
    mode = EMBEDDERS[kind][4]
    transformer = models.Transformer(str(hf))
    pooling = models.Pooling(transformer.get_embedding_dimension(), pooling_mode=mode)
    model = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    out = folder / "st"
    model.save(str(out))
    return out
