"""Tokenizers trained on the spot with the `tokenizers` library, saved beside a tiny model."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "In the beginning was the word, and the word was with the engine.",
    "The quick brown fox jumps over the lazy dog; 0123456789.",
    "Paged attention keeps the KV cache in blocks of sixteen tokens.",
    "日本語のテキストと中文文本，还有 emoji 🙂👍🏽 and accents: café, naïve.",  # noqa: RUF001
    "Stop strings end a request: STOP here, or END there.",
] * 20

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny models' pad, bos and eos

CHATML = (
    "{% for message in messages %}{{ '<s>' + message['role'] + '\\n' + message['content'] + "
    "'</s>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)


def byte_level_bpe(vocab_size: int = 384) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def save_tokenizer(folder: Path, tok: Tokenizer, chat_template: str | None = CHATML) -> int:
    """Writes tokenizer.json and tokenizer_config.json; returns the vocabulary size."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()
