//! Tiny tokenizers trained in the tests with the tokenizers crate's own trainer, in the two
//! shapes that Hugging Face checkpoints use: byte-level BPE (GPT-2, Qwen, Llama 3) and
//! SentencePiece-style BPE with byte fallback (Llama 2, Mistral).

use std::sync::OnceLock;

use serde_json::{json, Value};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::{AddedToken, Tokenizer};

/// Mixed-script training text; also the texts the tests encode.
pub const CORPUS: &[&str] = &[
    "The quick brown fox jumps over the lazy dog. It's 2024, and we're testing tokenizers!",
    "Hello, world! How are you doing today? I'm fine, thanks; the weather is nice.",
    "def main():\n    print(\"hello\")\n    return 0\n\nif __name__ == '__main__':\n\tmain()",
    "Numbers: 1234567890, 3.14159, -42, 1e-5, 0xFF, 100%, $19.99, €5, ¥300.",
    "Café, naïve, façade, résumé, jalapeño, Straße, Ærø, Øresund, coöperate.",
    "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.",
    "Γειά σου κόσμε! Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "你好，世界！今天天气很好。我们正在测试分词器。中文字符需要多个字节。",
    "こんにちは、世界！カタカナとひらがなと漢字。東京は日本の首都です。",
    "안녕하세요, 세계! 한국어는 한글로 씁니다. 반갑습니다.",
    "مرحبا بالعالم! هذا نص عربي يكتب من اليمين إلى اليسار.",
    "שלום עולם! זהו טקסט בעברית שנכתב מימין לשמאל.",
    "नमस्ते दुनिया! यह हिंदी पाठ है। संयुक्ताक्षर क्ष त्र ज्ञ।",
    "မင်္ဂလာပါ ကမ္ဘာလောက။ မြန်မာစာ စမ်းသပ်ခြင်း။",
    "สวัสดีชาวโลก! ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ ☺️ 🇯🇵 🇺🇸 1️⃣ 🧑🏿‍💻",
    "Combining: e\u{301} a\u{308} n\u{303} Z\u{351}\u{34b}\u{327}a\u{35b}\u{30c}l\u{318}g\u{300}o\u{301}",
    "Tabs\tand\t\ttabs, spaces:     five,          ten, newlines\n\n\nthree.",
    "Mixed: English 中文 русский العربية 日本語 한국어 עברית हिन्दी 😀 done.",
    "the the the the of of and and to to in in is is that that it it for for on on with with",
];

/// Every shape, by name.
pub fn all() -> Vec<(&'static str, Tokenizer)> {
    vec![
        ("byte_level", byte_level_bpe()),
        ("llama3", llama3_style_bpe()),
        ("byte_fallback", byte_fallback_bpe()),
        ("metaspace", metaspace_bpe()),
    ]
}

/// Texts with the hard cases for parity and streaming.
pub fn hard_texts() -> Vec<String> {
    let mut texts: Vec<String> = CORPUS.iter().map(|s| s.to_string()).collect();
    texts.extend(
        [
            "",
            " ",
            "  leading and trailing spaces  ",
            "\u{feff}BOM at the start",
            "NUL\u{0}inside\u{0}\u{0}text",
            "a\u{200d}b zero width joiner, \u{200b}zero width space",
            "\u{202e}right-to-left override\u{202c} and \u{200f}RLM",
            "🏳️‍🌈🏳️‍🌈👨‍👩‍👧‍👦👨‍👩‍👧‍👦",
            "\r\n\r\nwindows\r\nline endings\r\n",
            "<|im_start|>user\nhi<|im_end|>",
            "<s>[INST] special tokens in text [/INST]</s>",
            "\u{10ffff}\u{e000} private use and max code point",
        ]
        .map(String::from),
    );
    texts.push(" ".repeat(100) + "x" + &"\t".repeat(50));
    texts.push(CORPUS.join(" ").repeat(20));
    texts
}

/// GPT-2 / Qwen style: ByteLevel pre-tokenizer and decoder.
pub fn byte_level_bpe() -> Tokenizer {
    static TRAINED: OnceLock<String> = OnceLock::new();
    TRAINED.get_or_init(train_byte_level_bpe).parse().unwrap()
}

fn train_byte_level_bpe() -> String {
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(700)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![
            AddedToken::from("<|endoftext|>", true),
            AddedToken::from("<|im_start|>", true),
            AddedToken::from("<|im_end|>", true),
        ])
        .build()
        .into();
    tokenizer.train(&mut trainer, CORPUS.iter()).unwrap();
    tokenizer.to_string(false).unwrap()
}

/// Llama 3 style: the byte-level model behind a Split regex pre-tokenizer and a BOS template.
pub fn llama3_style_bpe() -> Tokenizer {
    let mut json = to_json(&byte_level_bpe());
    json["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
    ]});
    add_token(&mut json, "<|begin_of_text|>", true);
    add_token(&mut json, "<|eot_id|>", true);
    json["post_processor"] =
        bos_template("<|begin_of_text|>", token_id(&json, "<|begin_of_text|>"));
    from_json(json)
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 2 style: spaces become "▁" in a normalizer, unknown characters fall back to `<0xNN>`
/// byte tokens, and the decoder strips the one space that the normalizer prepended.
pub fn byte_fallback_bpe() -> Tokenizer {
    let mut json = to_json(&sentencepiece_like_model());
    json["normalizer"] = json!({"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    ]});
    json["pre_tokenizer"] = Value::Null;
    json["decoder"] = json!({"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}
    ]});
    json["post_processor"] = bos_template("<s>", 1);
    from_json(json)
}

/// Mistral / newer Llama style: the same model behind Metaspace pre-tokenizer and decoder.
pub fn metaspace_bpe() -> Tokenizer {
    let mut json = to_json(&sentencepiece_like_model());
    json["normalizer"] = Value::Null;
    json["pre_tokenizer"] =
        json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false});
    json["decoder"] = json!({"type": "Sequence", "decoders": [
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
        {"type": "ByteFallback"},
        {"type": "Fuse"}
    ]});
    from_json(json)
}

/// A BPE trained on "▁"-joined words with a small alphabet, plus the 256 `<0xNN>` tokens.
fn sentencepiece_like_model() -> Tokenizer {
    static TRAINED: OnceLock<String> = OnceLock::new();
    TRAINED
        .get_or_init(train_sentencepiece_like_model)
        .parse()
        .unwrap()
}

fn train_sentencepiece_like_model() -> String {
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::First, true)));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(500)
        .limit_alphabet(80)
        .show_progress(false)
        .special_tokens(vec![
            AddedToken::from("<unk>", true),
            AddedToken::from("<s>", true),
            AddedToken::from("</s>", true),
        ])
        .build()
        .into();
    tokenizer.train(&mut trainer, CORPUS.iter()).unwrap();
    let mut json = to_json(&tokenizer);
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    let mut next = vocab.len() as u64;
    for byte in 0..=255u8 {
        vocab.entry(format!("<0x{byte:02X}>")).or_insert_with(|| {
            next += 1;
            json!(next - 1)
        });
    }
    json["model"]["byte_fallback"] = json!(true);
    json["model"]["fuse_unk"] = json!(true);
    json["model"]["unk_token"] = json!("<unk>");
    json.to_string()
}

fn bos_template(bos: &str, bos_id: u64) -> Value {
    json!({"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}})
}

fn add_token(json: &mut Value, content: &str, special: bool) {
    let id = json["model"]["vocab"].as_object().unwrap().len()
        + json["added_tokens"].as_array().unwrap().len();
    json["added_tokens"].as_array_mut().unwrap().push(json!({
        "id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": false, "special": special
    }));
}

fn token_id(json: &Value, content: &str) -> u64 {
    json["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["content"] == content)
        .unwrap()["id"]
        .as_u64()
        .unwrap()
}

fn to_json(tokenizer: &Tokenizer) -> Value {
    serde_json::from_str(&tokenizer.to_string(false).unwrap()).unwrap()
}

fn from_json(json: Value) -> Tokenizer {
    json.to_string().parse().unwrap()
}
