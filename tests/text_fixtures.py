"""Tokenizers trained on the spot with the `tokenizers` library, for text-path tests.

Three families, each saved as a tokenizer.json (plus tokenizer_config.json):

- ``bytelevel``: GPT-2/Qwen style byte-level BPE (ByteLevel pre-tokenizer and decoder).
- ``llama3``: byte-level BPE behind a Llama-3-like Split regex pre-tokenizer.
- ``spm``: SentencePiece-style BPE with byte_fallback (Llama-2/Mistral style): normalizers
  Prepend("▁") + Replace(" ", "▁"), decoders Replace("▁", " ") + ByteFallback + Fuse +
  Strip(" ", 1, 0), ``<0x00>``..``<0xFF>`` in the vocabulary.

Training takes well under a second per tokenizer; the pytest fixtures are session-scoped.
"""

import json
from pathlib import Path

import pytest
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

# A few KB of mixed-script text.
CORPUS_LINES = [
    "In the beginning was the word, and the word was with the engine.",
    "The quick brown fox jumps over the lazy dog; 0123456789 times!",
    "Paged attention keeps the KV cache in blocks of sixteen tokens each.",
    "Continuous batching schedules prefill and decode steps together.",
    "def main():\n    print('hello, world')\n\treturn 0\n",
    "日本語のテキストと中文文本，还有韩国어 텍스트도 있습니다。",  # noqa: RUF001
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "emoji 🙂👍🏽 ❤️ 👨‍👩‍👧‍👦 🏳️‍🌈 and accents: café, naïve, résumé, Ångström.",
    "Ελληνικά γράμματα: αβγδε. Русский текст: привет, мир!",
    "العربية تكتب من اليمين إلى اليسار. עברית גם כן.",
    "မြန်မာဘာသာစကား ဖြစ်ပါသည်။ हिन्दी भाषा देवनागरी में लिखी जाती है।",
    "ไทยภาษาไม่มีช่องว่างระหว่างคำ. Tiếng Việt có nhiều dấu.",
    "Stop strings end a request: STOP here, or END there, <|end|> maybe.",
    "Numbers 3.14159 2.71828 1,000,000 and symbols @#$%^&*()[]{}<>.",
]
CORPUS = CORPUS_LINES * 12
# Prompts for end-to-end generation tests: short and long, non-Latin scripts, emoji, stops.
PROMPTS = [
    "The",
    "The quick brown fox",
    "In the beginning was the word",
    "Paged attention keeps the KV cache in blocks",
    "日本語のテキスト",
    "emoji 🙂👍🏽 and accents: café",
    "Stop strings end a request: STOP here, or END there. The quick brown fox jumps",
    "0123456789. The lazy dog; the engine, the word, the blocks of sixteen tokens.",
]

# ids 0..3 in every fixture
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|eot_id|>"]

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen-2 style: a default system message when none is given.
QWEN = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)


def _add_specials(tok: Tokenizer) -> None:
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])


def _prepend_bos(tok: Tokenizer) -> None:
    """Llama-style post-processor: encode(..., add_special_tokens=True) starts with <s>."""
    bos = SPECIALS.index("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )


def _train_byte_level(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    """Trains a byte-level BPE (ByteLevel decoder, all 256 bytes in the alphabet) on CORPUS."""
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    _add_specials(tok)
    return tok


def byte_level_bpe(vocab_size: int = 600) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return _train_byte_level(tok, vocab_size)


def llama3_bpe(vocab_size: int = 600) -> Tokenizer:
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    _train_byte_level(tok, vocab_size)
    _prepend_bos(tok)
    return tok


def spm_byte_fallback(vocab_size: int = 700) -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS + byte_tokens,
        show_progress=False,
        limit_alphabet=200,  # rarer characters fall back to bytes
    )
    tok.train_from_iterator(CORPUS, trainer)
    # The trainer makes the byte tokens "added" special tokens; in Llama-2 they are plain
    # vocabulary entries (decoded, not skipped), so drop them from added_tokens.
    data = json.loads(tok.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in SPECIALS]
    tok = Tokenizer.from_str(json.dumps(data))
    _add_specials(tok)
    _prepend_bos(tok)
    return tok


BUILDERS = {"bytelevel": byte_level_bpe, "llama3": llama3_bpe, "spm": spm_byte_fallback}


def save_model_dir(
    folder: Path,
    tok: Tokenizer,
    chat_template: str | None = CHATML,
    bos: str = "<s>",
    eos: str = "</s>",
) -> Path:
    """Writes tokenizer.json and tokenizer_config.json into folder; returns folder."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": bos,
        "eos_token": eos,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory) -> dict[str, Path]:
    """kind -> a folder holding tokenizer.json and tokenizer_config.json."""
    root = tmp_path_factory.mktemp("text_tokenizers")
    return {kind: save_model_dir(root / kind, build()) for kind, build in BUILDERS.items()}


@pytest.fixture(scope="session", params=list(BUILDERS))
def tok_kind(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def tok_pair(tokenizer_dirs, tok_kind):
    """(aieng Tokenizer, tokenizers.Tokenizer) loaded from the same tokenizer.json."""
    from aieng.core import Tokenizer as AiengTokenizer

    path = tokenizer_dirs[tok_kind] / "tokenizer.json"
    return AiengTokenizer.from_file(path), Tokenizer.from_file(str(path))
