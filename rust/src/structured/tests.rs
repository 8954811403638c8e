//! The grammar engine over the test tokenizers: valid outputs are allowed token by token and
//! complete their grammar; random walks under the masks always produce a valid output.

use std::sync::Arc;

use serde_json::{json, Value};

use super::*;
use crate::error::CoreError;
use crate::text::test_tokenizers::{byte_fallback_bpe, byte_level_bpe};
use crate::text::{Tokenizer, TokenizerConfig};

const EOS: u32 = 0;

fn compiler(vocab_size: usize) -> GrammarCompiler {
    let tok = Tokenizer::new(byte_level_bpe(), TokenizerConfig::default());
    GrammarCompiler::new(&tok, vocab_size).unwrap()
}

fn allowed(words: &[u32]) -> Vec<u32> {
    (0..words.len() * 32)
        .filter(|&t| words[t / 32] >> (t % 32) & 1 == 1)
        .map(|t| t as u32)
        .collect()
}

fn mask_of(m: &mut GrammarMatcher) -> Vec<u32> {
    let mut words = vec![0; m.mask_words()];
    m.fill_mask(&mut words);
    allowed(&words)
}

/// xorshift64*: a seeded generator, so a failure replays.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    }
}

/// Draws allowed tokens at random until the grammar completes or a stop token is drawn;
/// returns the text and whether it ended by completion or an allowed stop.
fn random_walk(compiler: &GrammarCompiler, spec: &GrammarSpec, seed: u64) -> (String, bool) {
    let grammar = compiler.compile(spec).unwrap();
    let mut m = grammar.matcher(vec![EOS]);
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut bytes = Vec::new();
    for _ in 0..400 {
        let options = mask_of(&mut m);
        assert!(!options.is_empty(), "{spec:?}: empty mask after {bytes:?}");
        let token = options[rng.below(options.len())];
        if token == EOS {
            assert!(m.is_accepting());
            return (String::from_utf8(bytes).unwrap(), true);
        }
        bytes.extend_from_slice(compiler.vocab().token_bytes(token));
        if m.accept(token).unwrap() {
            return (String::from_utf8(bytes).unwrap(), true);
        }
    }
    (String::from_utf8(bytes).unwrap(), false)
}

fn feed(compiler: &GrammarCompiler, spec: &GrammarSpec, text: &str) -> Result<bool, String> {
    let grammar = compiler.compile(spec).unwrap();
    let mut m = grammar.matcher(vec![EOS]);
    let tok = Tokenizer::new(byte_level_bpe(), TokenizerConfig::default());
    for token in tok.encode(text, false).unwrap() {
        if !mask_of(&mut m).contains(&token) {
            return Err(format!("token {token} refused"));
        }
        if m.accept(token)? {
            return Ok(true);
        }
    }
    Ok(m.is_accepting())
}

fn json_spec(schema: Value) -> GrammarSpec {
    GrammarSpec::Json(schema.to_string())
}

#[test]
fn valid_outputs_pass_and_invalid_ones_are_refused() {
    let c = compiler(700);
    let schema = json_spec(json!({
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": false,
    }));
    assert_eq!(feed(&c, &schema, r#"{"name":"Ann","age":42}"#), Ok(true));
    assert!(feed(&c, &schema, r#"{"name":"Ann","age":"x"}"#).is_err());
    assert!(feed(&c, &schema, r#"{"age":42}"#).is_err());
    let rx = GrammarSpec::Regex("[0-9]{3}-[a-z]+".into());
    assert_eq!(feed(&c, &rx, "123-abc"), Ok(true));
    assert!(feed(&c, &rx, "12-abc").is_err());
    let choice = GrammarSpec::Choice(vec!["yes".into(), "no".into()]);
    assert_eq!(feed(&c, &choice, "no"), Ok(true));
    assert!(feed(&c, &choice, "maybe").is_err());
}

#[test]
fn random_walks_under_the_masks_give_valid_json() {
    let c = compiler(700);
    let schemas = [
        json!({"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -5, "maximum": 500},
            "b": {"type": "string", "maxLength": 6},
            "c": {"enum": ["red", "green", 3]},
            "d": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        }, "required": ["a", "b", "c", "d"], "additionalProperties": false}),
        json!({"type": "array", "items": {"type": "number", "minimum": -1e6, "maximum": 1e6},
            "minItems": 1, "maxItems": 4}),
        json!({"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"}),
    ];
    for (i, schema) in schemas.iter().enumerate() {
        for seed in 0..8 {
            let (text, done) = random_walk(&c, &json_spec(schema.clone()), seed);
            assert!(
                done,
                "schema {i} seed {seed}: no end in 400 tokens: {text:?}"
            );
            let value: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("schema {i} seed {seed}: {text:?}: {e}"));
            match i {
                0 => {
                    let a = value["a"].as_i64().unwrap();
                    assert!((-5..=500).contains(&a), "{text}");
                    assert!(value["b"].as_str().unwrap().chars().count() <= 6, "{text}");
                    assert!([json!("red"), json!("green"), json!(3)].contains(&value["c"]));
                    let d = value["d"].as_array().unwrap();
                    assert!(d.len() <= 3 && d.iter().all(Value::is_boolean), "{text}");
                }
                1 => {
                    let items = value.as_array().unwrap();
                    assert!((1..=4).contains(&items.len()) && items.iter().all(Value::is_number));
                }
                _ => {
                    let s = value.as_str().unwrap();
                    assert!(s.len() >= 2 && s.len() <= 6, "{text}");
                    assert!(s.chars().next().unwrap().is_ascii_uppercase(), "{text}");
                    assert!(
                        s.chars().skip(1).all(|ch| ch.is_ascii_lowercase()),
                        "{text}"
                    );
                }
            }
        }
    }
}

#[test]
fn random_walks_fullmatch_regexes_and_choices() {
    let c = compiler(700);
    for seed in 0..16 {
        let (text, _) = random_walk(&c, &GrammarSpec::Regex("(ab|cd)[0-9]{2}x?".into()), seed);
        let b = text.as_bytes();
        assert!(text.len() == 4 || text.len() == 5, "{text:?}");
        assert!(&text[..2] == "ab" || &text[..2] == "cd", "{text:?}");
        assert!(b[2].is_ascii_digit() && b[3].is_ascii_digit(), "{text:?}");
        assert!(text.len() == 4 || b[4] == b'x', "{text:?}");
        let choices = vec!["alpha".to_string(), "alphabet".into(), "b \"q\"".into()];
        let (text, done) = random_walk(&c, &GrammarSpec::Choice(choices.clone()), seed);
        assert!(done && choices.contains(&text), "{text:?}");
    }
}

#[test]
fn lark_grammars_constrain_too() {
    let c = compiler(700);
    let lark = GrammarSpec::Grammar("start: item (\",\" item)*\nitem: /[0-9]/ | \"x\"\n".into());
    assert_eq!(feed(&c, &lark, "1,x,3"), Ok(true));
    assert!(feed(&c, &lark, "1,,3").is_err());
}

#[test]
fn stop_ids_are_allowed_only_where_the_grammar_may_end() {
    let c = compiler(700);
    let grammar = c.compile(&GrammarSpec::Regex("[0-9]+".into())).unwrap();
    let mut m = grammar.matcher(vec![EOS, 5]);
    let first = mask_of(&mut m);
    assert!(!first.contains(&EOS) && !first.contains(&5));
    let tok = Tokenizer::new(byte_level_bpe(), TokenizerConfig::default());
    let seven = tok.encode("7", false).unwrap();
    assert_eq!(seven.len(), 1);
    assert_eq!(m.accept(seven[0]), Ok(false));
    let next = mask_of(&mut m);
    assert!(next.contains(&EOS) && next.contains(&5) && next.contains(&seven[0]));
    // No special token other than the stop ids.
    assert!(!next.contains(&1) && !next.contains(&2));
}

#[test]
fn the_first_step_tells_which_tokens_may_start_the_output() {
    let c = compiler(700);
    let tok = Tokenizer::new(byte_level_bpe(), TokenizerConfig::default());
    let [seven, a] = ["7", "a"].map(|t| tok.encode(t, false).unwrap()[0]);
    let digits = c.compile(&GrammarSpec::Regex("[0-9]+".into())).unwrap();
    let every: Vec<u32> = (0..700).collect();
    let mut m = digits.matcher(vec![EOS]);
    assert_eq!(digits.allowed_first(&every, &[EOS]), mask_of(&mut m));
    assert_eq!(
        digits.allowed_first(&[a, EOS, 900], &[EOS]),
        Vec::<u32>::new()
    );
    assert_eq!(digits.allowed_first(&[a, seven], &[]), vec![seven]);
    // A grammar that may end at once allows the stop ids first, and only those given.
    let maybe = c.compile(&GrammarSpec::Regex("[0-9]*".into())).unwrap();
    assert_eq!(maybe.allowed_first(&[a, EOS, 5], &[EOS]), vec![EOS]);
    let mut m = maybe.matcher(vec![EOS]);
    assert_eq!(maybe.allowed_first(&every, &[EOS]), mask_of(&mut m));
}

#[test]
fn masks_have_the_models_width() {
    let wide = compiler(1000);
    let grammar = wide.compile(&GrammarSpec::JsonObject).unwrap();
    let mut m = grammar.matcher(vec![EOS]);
    assert_eq!(m.mask_words(), 1000usize.div_ceil(32));
    assert!(mask_of(&mut m).iter().all(|&t| t < 700));
    let narrow = compiler(100); // a model narrower than its tokenizer
    let grammar = narrow.compile(&GrammarSpec::JsonObject).unwrap();
    let mut m = grammar.matcher(vec![EOS]);
    assert_eq!(m.mask_words(), 4);
    assert!(mask_of(&mut m).iter().all(|&t| t < 100));
}

#[test]
fn invalid_constraints_are_invalid_arguments_naming_the_problem() {
    let c = compiler(700);
    let cases = [
        (GrammarSpec::Regex("[a-".into()), "regex: "),
        (GrammarSpec::Grammar("start: foo\n".into()), "grammar: "),
        (json_spec(json!({"type": "frobnicate"})), "json: "),
        (
            json_spec(json!({"$ref": "#/definitions/missing"})),
            "json: ",
        ),
    ];
    for (spec, prefix) in cases {
        match c.compile(&spec) {
            Err(CoreError::InvalidArgument(m)) => {
                assert!(
                    m.starts_with(prefix) && m.len() > prefix.len(),
                    "{spec:?}: {m}"
                )
            }
            Err(other) => panic!("{spec:?}: wrong error {other:?}"),
            Ok(_) => panic!("{spec:?}: compiled"),
        }
    }
}

#[test]
fn compiled_grammars_are_shared_and_matchers_are_not() {
    let c = compiler(700);
    let spec = GrammarSpec::Choice(vec!["ab".into(), "cd".into()]);
    let (g1, g2) = (c.compile(&spec).unwrap(), c.compile(&spec).unwrap());
    assert!(Arc::ptr_eq(&g1, &g2));
    let tok = Tokenizer::new(byte_level_bpe(), TokenizerConfig::default());
    let mut a = g1.matcher(vec![EOS]);
    let b_mask_before = mask_of(&mut g1.matcher(vec![EOS]));
    for t in tok.encode("ab", false).unwrap() {
        a.accept(t).unwrap();
    }
    assert!(a.is_finished());
    assert_eq!(mask_of(&mut g1.matcher(vec![EOS])), b_mask_before);
}

#[test]
fn byte_fallback_vocabularies_work() {
    let tok = Tokenizer::new(byte_fallback_bpe(), TokenizerConfig::default());
    let c = GrammarCompiler::new(&tok, 700).unwrap();
    for seed in 0..4 {
        let spec = GrammarSpec::Regex("[é€]{2}[a-c]".into());
        let (text, _) = random_walk(&c, &spec, seed);
        let chars: Vec<char> = text.chars().collect();
        assert_eq!(chars.len(), 3, "{text:?}");
        assert!(chars[..2].iter().all(|ch| "é€".contains(*ch)) && "abc".contains(chars[2]));
    }
}

#[test]
fn pending_masks_are_computed_off_thread_and_joined_once() {
    let c = compiler(700);
    let grammar = c.compile(&GrammarSpec::Regex("[0-9]+".into())).unwrap();
    let rows = vec![
        (2, grammar.matcher(vec![EOS]).shared(), vec![]),
        (5, grammar.matcher(vec![]).shared(), vec![]),
    ];
    let pending = PendingMasks::start(rows);
    let masks = pending.wait();
    assert_eq!(masks.rows, vec![2, 5]);
    assert_eq!(masks.words.len(), 2 * masks.words_per_row);
    let digits = allowed(&masks.words[..masks.words_per_row]);
    assert!(!digits.is_empty() && !digits.contains(&EOS));
    assert!(std::ptr::eq(masks, pending.clone().wait()));
}

fn refusal(c: &GrammarCompiler, spec: &GrammarSpec) -> String {
    match c.compile(spec) {
        Err(CoreError::InvalidArgument(m)) => m,
        Err(other) => panic!("{spec:?}: wrong error {other:?}"),
        Ok(_) => panic!("{spec:?}: compiled"),
    }
}

#[test]
fn grammars_that_match_nothing_are_refused_at_compile_time() {
    let c = compiler(700);
    let cases = [
        json_spec(json!({"$ref": "#"})),
        json_spec(
            json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                         "$ref": "#/$defs/a"}),
        ),
        GrammarSpec::Regex("[^\\s\\S]".into()),
        GrammarSpec::Grammar("start: x\nx: x \"a\"\n".into()),
        GrammarSpec::Json("false".into()),
    ];
    for spec in cases {
        let m = refusal(&c, &spec);
        let kind = format!("{}: ", spec.kind());
        assert!(
            m.starts_with(&kind) && m.contains("matches nothing"),
            "{spec:?}: {m}"
        );
    }
    // A dead branch is named: it would leave a request with no token to draw.
    let dead = GrammarSpec::Grammar("start: \"a\" | \"b\" loop\nloop: \"c\" loop\n".into());
    let m = refusal(&c, &dead);
    assert!(
        m.contains("the rule \"loop\" can never be completed"),
        "{m}"
    );
    // Recursion with a way out is fine, and so is a grammar of the empty string.
    let ok = [
        GrammarSpec::Grammar("start: x\nx: x \"a\" | \"b\"\n".into()),
        json_spec(json!({"type": "object", "properties": {"next": {"$ref": "#"}}})),
        GrammarSpec::Regex("a{0}".into()),
        GrammarSpec::Json("true".into()),
    ];
    for spec in ok {
        assert!(c.compile(&spec).is_ok(), "{spec:?}");
    }
}

#[test]
fn grammars_past_the_parser_row_limit_are_refused_at_compile_time() {
    let c = compiler(700);
    let words = |n: usize| (0..n).map(|i| format!("w{i}")).collect::<Vec<String>>();
    assert!(c.compile(&GrammarSpec::Choice(words(1999))).is_ok());
    let m = refusal(&c, &GrammarSpec::Choice(words(20_000)));
    assert!(m.starts_with("choice: 20000 strings is too many"), "{m}");
    let alternatives = |n: usize| {
        let quoted: Vec<String> = words(n).iter().map(|w| format!("\"{w}\"")).collect();
        GrammarSpec::Grammar(format!("start: {}\n", quoted.join(" | ")))
    };
    assert!(c.compile(&alternatives(1999)).is_ok());
    let m = refusal(&c, &alternatives(2000));
    assert!(
        m.starts_with("grammar: too many alternatives at one point: the rule \"start\""),
        "{m}"
    );
    // An object's optional properties are alternatives at each step: 498 fit in a row.
    let object = |n: usize| {
        let properties: serde_json::Map<String, Value> = words(n)
            .into_iter()
            .map(|p| (p, json!({"type": "integer"})))
            .collect();
        json_spec(json!({"type": "object", "properties": properties}))
    };
    assert!(c.compile(&object(498)).is_ok());
    let m = refusal(&c, &object(499));
    assert!(
        m.starts_with("json: too many alternatives at one point: one of its rules"),
        "{m}"
    );
    let m = refusal(&c, &object(10_000));
    assert!(
        m.starts_with("json: an object with 10000 optional properties"),
        "{m}"
    );
}

#[test]
fn admitted_grammars_do_not_fail_in_the_first_steps() {
    let c = compiler(700);
    let words: Vec<String> = (0..1999).map(|i| format!("w{i}")).collect();
    let specs = [
        GrammarSpec::Choice(words.clone()),
        json_spec(json!({"type": "object", "properties":
            words[..498].iter().map(|w| (w.clone(), json!({"type": "integer"})))
                .collect::<serde_json::Map<String, Value>>()})),
    ];
    for spec in &specs {
        for seed in 0..3 {
            let (text, _) = random_walk(&c, spec, seed);
            assert!(!text.is_empty(), "{spec:?}");
        }
    }
}

#[test]
fn the_cache_is_bounded_by_count_and_keeps_recent_grammars() {
    let c = compiler(700);
    let first = c.compile(&GrammarSpec::Regex("a+".into())).unwrap();
    for i in 0..300 {
        c.compile(&GrammarSpec::Regex(format!("b{{{i}}}"))).unwrap();
        // kept warm: the most recently used survive eviction
        assert!(Arc::ptr_eq(
            &first,
            &c.compile(&GrammarSpec::Regex("a+".into())).unwrap()
        ));
    }
    assert_eq!(c.cached().0, 256);
}

#[test]
fn the_cache_is_bounded_by_bytes() {
    let choice = |i: usize| {
        let long = "x".repeat(2000);
        GrammarSpec::Choice((0..50).map(|j| format!("{i} {j} {long}")).collect())
    };
    let one = compiler(700).compile(&choice(0)).unwrap().estimated_bytes();
    assert!(one > 6 * 50 * 2000, "{one}"); // at least its strings, as held in the lexer
    let c = compiler(700).with_cache(100, 3 * one + one / 2);
    for i in 0..6 {
        c.compile(&choice(i)).unwrap();
    }
    let (entries, bytes) = c.cached();
    assert!(
        entries == 3 && bytes <= 3 * one + one / 2,
        "{entries} {bytes}"
    );
    let last = c.compile(&choice(5)).unwrap();
    assert!(Arc::ptr_eq(&last, &c.compile(&choice(5)).unwrap()));
}
