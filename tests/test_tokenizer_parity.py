# ruff: noqa: RUF001  (the test texts are full of look-alike characters)
"""aieng's Rust Tokenizer against the Python `tokenizers` package and transformers' chat templates.

Every fixture tokenizer (byte-level BPE, Llama-3-like Split+ByteLevel BPE, SentencePiece-style
BPE with byte_fallback) must give the same ids as `tokenizers.Tokenizer.encode(...).ids` and
the same text as `tokenizers.Tokenizer.decode(...)`.
"""

import json
import warnings

import pytest
import text_fixtures
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from text_fixtures import BUILDERS, CHATML, LLAMA2, LLAMA3, QWEN, SPECIALS, save_model_dir

import aieng
from aieng.core import Tokenizer

# pytest fixtures shared with test_streaming_text.py
tokenizer_dirs = text_fixtures.tokenizer_dirs
tok_kind = text_fixtures.tok_kind
tok_pair = text_fixtures.tok_pair

TEXTS = {
    "empty": "",
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog. 0123456789",
    "code": "def f(x):\n\treturn x ** 2  # square\n\n\nclass A:\n    pass\n",
    "cjk": "日本語のテキストと中文文本，还有한국어 텍스트。東京タワー",
    "emoji": "❤️ ☺︎ 👍🏽👍🏿 👨‍👩‍👧‍👦 🏳️‍🌈 🧑🏾‍🚀 🇯🇵🇺🇸 #️⃣ 🦀🦀🦀",
    "burmese": "မြန်မာဘာသာစကား ဖြစ်ပါသည်။ ကျေးဇူးတင်ပါတယ်",
    "combining": "e\u0301 a\u0308\u0323 Z\u0324\u0354\u0367\u0311\u0313 n\u0303o\u0302 "
    "\u0915\u093f",
    "rtl": "العربية تكتب من اليمين إلى اليسار. \u200fעברית\u200e mixed עם English 123.",
    "whitespace": "a\t\tb" + " " * 100 + "c\n\n\n   \r\n\t \u00a0\u3000\u2003 end   ",
    "bom": "\ufeffhello \ufeff world\ufeff",
    "nul": "a\x00b\x00\x00 c\x00",
    "controls": "\x01\x02\x1b[31mred\x1b[0m\x7f\u200b\u2028\u2029",
    "specials": "<|im_start|>user\nhi<|im_end|>\n<s> a </s><|eot_id|>x<unk>",
    "lookalike": "<|im_start |> <s > </s< <0x41> ▁ ▁▁x ▁",
    "astral": "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 𠀀𠀁 \U0010ffff \ufffd",
}
TEXTS["long"] = (" ".join(v for k, v in TEXTS.items() if k != "specials") + "\n") * 115
assert len(TEXTS["long"].encode()) > 100_000


# ------------------------------------------------------------------ encode


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_parity(tok_pair, name, add_special_tokens):
    ours, ref = tok_pair
    text = TEXTS[name]
    expected = ref.encode(text, add_special_tokens=add_special_tokens).ids
    assert ours.encode(text, add_special_tokens=add_special_tokens) == expected


def test_add_special_tokens_prepends_bos(tok_pair, tok_kind):
    ours, _ = tok_pair
    with_bos = ours.encode("hello", add_special_tokens=True)
    without = ours.encode("hello", add_special_tokens=False)
    if tok_kind == "bytelevel":  # no post-processor: Qwen style
        assert with_bos == without
    else:
        assert with_bos == [SPECIALS.index("<s>"), *without]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_batch_equals_encode(tok_pair, add_special_tokens):
    ours, ref = tok_pair
    texts = list(TEXTS.values()) * 3
    batch = ours.encode_batch(texts, add_special_tokens=add_special_tokens)
    assert batch == [ours.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    expected = ref.encode_batch(texts, add_special_tokens=add_special_tokens)
    assert batch == [e.ids for e in expected]
    assert ours.encode_batch([], add_special_tokens=add_special_tokens) == []


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(st.characters(exclude_categories=("Cs",)), max_size=80))
def test_encode_parity_random(tok_pair, text):
    ours, ref = tok_pair
    assert ours.encode(text) == ref.encode(text).ids
    assert (
        ours.encode(text, add_special_tokens=False)
        == ref.encode(text, add_special_tokens=False).ids
    )


@pytest.mark.parametrize("text", ["\ud800", "abc\udfffdef", "\udc00\ud800"])
def test_lone_surrogate_is_a_clear_value_error(tok_pair, text):
    ours, _ = tok_pair
    with pytest.raises(ValueError, match="surrogate"):
        ours.encode(text)
    with pytest.raises(ValueError, match="surrogate"):
        ours.encode_batch(["fine", text])
    assert ours.encode("still works") == ours.encode("still works")


# ------------------------------------------------------------------ decode


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("skip", [True, False])
def test_decode_parity(tok_pair, name, skip):
    ours, ref = tok_pair
    ids = ref.encode(TEXTS[name]).ids
    assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_decode_roundtrip_without_specials(tok_pair, tok_kind):
    ours, _ = tok_pair
    for name, text in TEXTS.items():
        if name in ("specials", "empty"):
            continue
        decoded = ours.decode(ours.encode(text, add_special_tokens=False))
        if tok_kind == "spm":
            # "▁" in the input decodes to a space; Prepend("▁") + Strip(" ", 1, 0) drops a
            # leading space.
            text = text.replace("▁", " ")
            assert decoded in (text, text.removeprefix(" ")), name
        else:
            assert decoded == text, name


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), skip=st.booleans())
def test_decode_parity_random_ids(tok_pair, data, skip):
    """Arbitrary id sequences, invalid UTF-8 and specials included."""
    ours, ref = tok_pair
    n = ref.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, n - 1), max_size=40))
    assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_decode_accepts_numpy(tok_pair):
    np = pytest.importorskip("numpy")
    ours, _ = tok_pair
    ids = ours.encode(TEXTS["cjk"])
    for dtype in (np.int32, np.int64, np.uint32):
        assert ours.decode(np.array(ids, dtype=dtype)) == ours.decode(ids)


def test_vocab_and_special_lookups(tok_pair):
    ours, ref = tok_pair
    assert ours.vocab_size == ref.get_vocab_size()
    for token in [*SPECIALS, "e", "<0x41>", "not-a-token-xyz"]:
        assert ours.token_to_id(token) == ref.token_to_id(token)
    for i in (0, 1, 2, 7, 100, ref.get_vocab_size() - 1):
        assert ours.id_to_token(i) == ref.id_to_token(i)
    assert ours.id_to_token(10**6) is None
    for s in SPECIALS:
        assert ours.is_special(ref.token_to_id(s))
    assert not ours.is_special(ref.token_to_id("e"))


# ------------------------------------------------------------------ from_dir


def test_from_dir_reads_config(tokenizer_dirs, tok_kind):
    tok = Tokenizer.from_dir(tokenizer_dirs[tok_kind])
    assert tok.bos_token == "<s>" and tok.bos_token_id == 1
    assert tok.eos_token == "</s>" and tok.eos_token_ids == [2]
    assert tok.chat_template == CHATML


def test_from_dir_generation_config_eos_list(tmp_path):
    folder = save_model_dir(tmp_path / "m", BUILDERS["bytelevel"]())
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": [4, 5, 2]})
    )
    tok = Tokenizer.from_dir(folder)
    assert set(tok.eos_token_ids) == {2, 4, 5}
    assert len(tok.eos_token_ids) == 3


def test_from_dir_generation_config_eos_int(tmp_path):
    folder = save_model_dir(tmp_path / "m", BUILDERS["bytelevel"]())
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    tok = Tokenizer.from_dir(folder)
    assert 5 in tok.eos_token_ids


def test_from_dir_chat_template_jinja_wins(tmp_path):
    folder = save_model_dir(tmp_path / "m", BUILDERS["bytelevel"](), chat_template=CHATML)
    (folder / "chat_template.jinja").write_text(QWEN)
    tok = Tokenizer.from_dir(folder)
    assert tok.chat_template == QWEN
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out.startswith("<|im_start|>system\nYou are a helpful assistant.")


def test_from_dir_missing_tokenizer(tmp_path):
    with pytest.raises(aieng.AiengError):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(aieng.AiengError):
        Tokenizer.from_file(tmp_path / "nope.json")


# ------------------------------------------------------------------ chat templates

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello there!"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi": [
        {"role": "system", "content": "Be nice. 日本語 OK 🙂"},
        {"role": "user", "content": "  Hi  "},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me\na joke."},
    ],
    "no_system_multi": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
}
TEMPLATES = {"chatml": CHATML, "qwen": QWEN, "llama3": LLAMA3, "llama2": LLAMA2}


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dirs):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(tokenizer_dirs["llama3"] / "tokenizer.json"),
            bos_token="<s>",
            eos_token="</s>",
        )


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(
    tokenizer_dirs, hf_tokenizer, template, conversation, add_generation_prompt
):
    messages = CONVERSATIONS[conversation]
    expected = hf_tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=TEMPLATES[template],
    )
    ours = Tokenizer.from_dir(tokenizer_dirs["llama3"])
    got = ours.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, chat_template=TEMPLATES[template]
    )
    assert got == expected


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_chat_template_from_config_matches_transformers(tmp_path, hf_tokenizer, template):
    folder = save_model_dir(tmp_path / template, BUILDERS["llama3"](), TEMPLATES[template])
    ours = Tokenizer.from_dir(folder)
    messages = CONVERSATIONS["multi"]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=TEMPLATES[template]
    )
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == expected


def test_chat_template_kwargs_reach_template(tokenizer_dirs, hf_tokenizer):
    template = "{{ greeting }}{% for m in messages %}|{{ m['content'] }}{% endfor %}{{ n * 2 }}"
    messages = CONVERSATIONS["user"]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, chat_template=template, greeting="hey", n=21
    )
    ours = Tokenizer.from_dir(tokenizer_dirs["llama3"])
    assert ours.apply_chat_template(messages, chat_template=template, greeting="hey", n=21) == (
        expected
    )


def test_llama2_bad_alternation_raises(tokenizer_dirs, hf_tokenizer):
    messages = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ]
    with pytest.raises(Exception, match="alternate"):
        hf_tokenizer.apply_chat_template(messages, tokenize=False, chat_template=LLAMA2)
    ours = Tokenizer.from_dir(tokenizer_dirs["llama3"])
    with pytest.raises(aieng.ChatTemplateError, match="alternate"):
        ours.apply_chat_template(messages, chat_template=LLAMA2)
    assert issubclass(aieng.ChatTemplateError, ValueError)


def test_no_template_raises(tmp_path):
    folder = save_model_dir(tmp_path / "m", BUILDERS["bytelevel"](), chat_template=None)
    tok = Tokenizer.from_dir(folder)
    assert tok.chat_template is None
    with pytest.raises(aieng.ChatTemplateError):
        tok.apply_chat_template(CONVERSATIONS["user"])
    # An explicit template still works.
    assert tok.apply_chat_template(CONVERSATIONS["user"], chat_template=CHATML).startswith(
        "<|im_start|>user\nHello"
    )


def test_from_file_has_no_template(tokenizer_dirs):
    tok = Tokenizer.from_file(tokenizer_dirs["bytelevel"] / "tokenizer.json")
    with pytest.raises(aieng.ChatTemplateError):
        tok.apply_chat_template(CONVERSATIONS["user"])


def test_broken_template_raises(tokenizer_dirs):
    tok = Tokenizer.from_dir(tokenizer_dirs["bytelevel"])
    with pytest.raises(aieng.ChatTemplateError):
        tok.apply_chat_template(CONVERSATIONS["user"], chat_template="{% for m in messages %}")
