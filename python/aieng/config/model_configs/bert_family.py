"""The architectures `aieng.models.bert` implements, and how each one's config.json reads: BERT
(Devlin et al., 2019), RoBERTa (Liu et al., 2019) and XLM-RoBERTa (Conneau et al., 2020) — the
encoders behind BGE, e5 and multilingual-e5. Encoder-only: they embed and never generate."""

from __future__ import annotations

from typing import Any

from aieng.config.architectures import ArchitectureSpec, ParseContext
from aieng.config.fields import Fields

# config.json `hidden_act` -> ours (transformers' gelu is the exact, erf form)
GELU_FORMS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def _encoder_fields(fields: Fields, ctx: ParseContext, position_offset: int) -> dict[str, Any]:
    act = fields.get("hidden_act", str, default="gelu")
    if act not in GELU_FORMS:
        raise ValueError(
            f"{fields.source}: field 'hidden_act' = {act!r} is not supported by the encoder "
            f"(supported: {', '.join(GELU_FORMS)})"
        )
    kind = fields.get("position_embedding_type", str, default="absolute")
    if kind != "absolute":
        raise ValueError(
            f"{fields.source}: field 'position_embedding_type' = {kind!r} is not supported "
            "(only 'absolute' is)"
        )
    if ctx.max_positions <= position_offset:
        raise ValueError(
            f"{fields.source}: field 'max_position_embeddings' ({ctx.max_positions}) leaves no "
            f"position after the offset {position_offset}"
        )
    return dict(
        is_encoder=True,
        embeds_only=True,
        hidden_act=GELU_FORMS[act],
        layer_norm_eps=fields.positive_float("layer_norm_eps", default=1e-12),
        type_vocab_size=fields.positive_int("type_vocab_size", default=2),
        position_offset=position_offset,
        # the longest prompt: the positions the table holds after the offset
        max_position_embeddings=ctx.max_positions - position_offset,
    )


def bert_fields(fields: Fields, ctx: ParseContext) -> dict[str, Any]:
    return _encoder_fields(fields, ctx, position_offset=0)


def roberta_fields(fields: Fields, ctx: ParseContext) -> dict[str, Any]:
    """RoBERTa numbers positions from pad_token_id + 1 (its position table keeps the first
    pad_token_id + 1 rows unused)."""
    pad = fields.get("pad_token_id", int, default=1)
    return _encoder_fields(fields, ctx, position_offset=pad + 1)


def _spec(parse) -> ArchitectureSpec:
    return ArchitectureSpec(family="bert", qkv_bias="never", silu_only=False, extra_fields=(parse,))


SPECS: dict[str, ArchitectureSpec] = {
    "BertModel": _spec(bert_fields),
    "RobertaModel": _spec(roberta_fields),
    "XLMRobertaModel": _spec(roberta_fields),
}
