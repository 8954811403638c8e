//! What a request constrains its output to, and the llguidance grammar for it.

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::JsonCompileOptions;
use serde_json::{json, Value};

use crate::error::{CoreError, Result};

/// One constraint, with vLLM's and OpenAI's kinds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GrammarSpec {
    /// A JSON schema (the text of one JSON value).
    Json(String),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A regular expression the whole output must match.
    Regex(String),
    /// The output is exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar as llguidance reads it.
    Grammar(String),
}

impl GrammarSpec {
    /// `kind` is one of json, json_object, regex, choice (source: a JSON list of strings)
    /// or grammar.
    pub fn parse(kind: &str, source: &str) -> Result<Self> {
        let invalid = |m: String| CoreError::InvalidArgument(m);
        Ok(match kind {
            "json" => GrammarSpec::Json(source.to_string()),
            "json_object" => GrammarSpec::JsonObject,
            "regex" => GrammarSpec::Regex(source.to_string()),
            "grammar" => GrammarSpec::Grammar(source.to_string()),
            "choice" => {
                let choices: Vec<String> = serde_json::from_str(source)
                    .map_err(|e| invalid(format!("choice must be a list of strings: {e}")))?;
                GrammarSpec::Choice(choices)
            }
            other => {
                return Err(invalid(format!(
                    "unknown structured output kind {other:?} (one of json, json_object, regex, \
                     choice, grammar)"
                )))
            }
        })
    }

    /// The name users know the constraint by, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::Json(_) => "json",
            GrammarSpec::JsonObject => "json_object",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Choice(_) => "choice",
            GrammarSpec::Grammar(_) => "grammar",
        }
    }

    /// Bytes of the constraint's text (a choice list counts its strings).
    pub fn source_len(&self) -> usize {
        match self {
            GrammarSpec::Json(text) | GrammarSpec::Regex(text) | GrammarSpec::Grammar(text) => {
                text.len()
            }
            GrammarSpec::JsonObject => 0,
            GrammarSpec::Choice(choices) => choices.iter().map(|c| c.len() + 3).sum(),
        }
    }

    /// The llguidance grammar; malformed JSON, a non-schema or an empty choice list is
    /// refused here, and so is what is sure to be past the parser's `limits` (its work grows
    /// faster than its size, so it is refused before any compiling); the rest when the grammar
    /// is compiled.
    pub fn to_grammar(&self, limits: &ParserLimits) -> Result<TopLevelGrammar> {
        let invalid = |m: String| CoreError::InvalidArgument(format!("{}: {m}", self.kind()));
        let most = limits.max_items_in_row;
        if let GrammarSpec::Regex(text) | GrammarSpec::Grammar(text) = self {
            if text.len() > MAX_SOURCE_BYTES {
                return Err(invalid(format!(
                    "{} bytes is too long: at most {MAX_SOURCE_BYTES} are supported",
                    text.len()
                )));
            }
        }
        Ok(match self {
            GrammarSpec::Json(text) => {
                let schema: Value = serde_json::from_str(text)
                    .map_err(|e| invalid(format!("the schema is not valid JSON: {e}")))?;
                check_optional_properties(&schema, most).map_err(invalid)?;
                TopLevelGrammar::from_json_schema(compact(schema).map_err(invalid)?)
            }
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(
                compact(json!({"type": "object"})).map_err(invalid)?,
            ),
            GrammarSpec::Regex(rx) => {
                if rx.is_empty() {
                    return Err(invalid("the regex is empty".into()));
                }
                TopLevelGrammar::from_regex(rx)
            }
            GrammarSpec::Choice(choices) => {
                if choices.is_empty() {
                    return Err(invalid("the list of choices is empty".into()));
                }
                // One parser row holds every choice, and the item that predicts them.
                if choices.len() >= most {
                    return Err(invalid(format!(
                        "{} strings is too many: at most {} are supported",
                        choices.len(),
                        most - 1
                    )));
                }
                TopLevelGrammar::from_lark(choice_lark(choices))
            }
            GrammarSpec::Grammar(lark) => {
                if lark.trim().is_empty() {
                    return Err(invalid("the grammar is empty".into()));
                }
                TopLevelGrammar::from_lark(lark.clone())
            }
        })
    }
}

/// Regexes and Lark grammars longer than this are refused unread: compiling one that size
/// takes seconds, and hand-written ones are a few kilobytes.
const MAX_SOURCE_BYTES: usize = 256 << 10;

/// Schema keywords whose values are JSON data, not schemas.
const VALUE_KEYWORDS: [&str; 4] = ["const", "enum", "default", "examples"];

/// Optional properties are alternatives at every step of their object, about four parser items
/// each (498 fit in the default row of 2000), and compiling them takes time quadratic in their
/// number: an object with more than half the row limit of them is refused before compiling
/// (fewer may still be past the limit, which the compiler's admission check finds).
fn check_optional_properties(schema: &Value, most: usize) -> std::result::Result<(), String> {
    match schema {
        Value::Object(map) => {
            if let Some(Value::Object(properties)) = map.get("properties") {
                let required = match map.get("required") {
                    Some(Value::Array(names)) => names
                        .iter()
                        .filter(|n| n.as_str().is_some_and(|n| properties.contains_key(n)))
                        .count(),
                    _ => 0,
                };
                let optional = properties.len().saturating_sub(required);
                if optional > most / 2 {
                    return Err(format!(
                        "an object with {optional} optional properties is past the grammar \
                         engine's limit ({most} parser items in one step): make properties \
                         required or split the object"
                    ));
                }
            }
            map.iter()
                .filter(|(key, _)| !VALUE_KEYWORDS.contains(&key.as_str()))
                .try_for_each(|(_, v)| check_optional_properties(v, most))
        }
        Value::Array(items) => items
            .iter()
            .try_for_each(|v| check_optional_properties(v, most)),
        _ => Ok(()),
    }
}

/// A schema with llguidance's compact JSON layout (no whitespace between tokens) unless the
/// schema sets its own `x-guidance` options: free whitespace lets a model pad forever.
fn compact(schema: Value) -> std::result::Result<Value, String> {
    let mut schema = match schema {
        Value::Bool(true) => json!({}),
        Value::Bool(false) => return Err("the schema `false` matches nothing".into()),
        Value::Object(_) => schema,
        other => {
            return Err(format!(
                "the schema must be a JSON object or a boolean, got {other}"
            ))
        }
    };
    if schema.get("x-guidance").is_none() {
        let options = JsonCompileOptions {
            whitespace_flexible: false,
            ..JsonCompileOptions::default()
        };
        options.apply_to(&mut schema);
    }
    Ok(schema)
}

/// `start: "a" | "b"`, each choice a JSON-quoted Lark string literal.
fn choice_lark(choices: &[String]) -> String {
    let alternatives: Vec<String> = choices
        .iter()
        .map(|c| serde_json::to_string(c).expect("a string serializes"))
        .collect();
    format!("start: {}\n", alternatives.join(" | "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kinds_and_refuses_unknown_ones() {
        assert_eq!(
            GrammarSpec::parse("choice", r#"["a","b"]"#).unwrap(),
            GrammarSpec::Choice(vec!["a".into(), "b".into()])
        );
        assert_eq!(
            GrammarSpec::parse("json_object", "").unwrap(),
            GrammarSpec::JsonObject
        );
        let err = GrammarSpec::parse("yaml", "").unwrap_err().to_string();
        assert!(
            err.contains("unknown structured output kind \"yaml\""),
            "{err}"
        );
        let err = GrammarSpec::parse("choice", "[1]").unwrap_err().to_string();
        assert!(err.contains("choice must be a list of strings"), "{err}");
    }

    #[test]
    fn refuses_malformed_constraints_naming_them() {
        let cases = [
            (
                GrammarSpec::Json("{".into()),
                "json: the schema is not valid JSON",
            ),
            (
                GrammarSpec::Json("3".into()),
                "json: the schema must be a JSON object",
            ),
            (
                GrammarSpec::Json("false".into()),
                "json: the schema `false`",
            ),
            (
                GrammarSpec::Regex(String::new()),
                "regex: the regex is empty",
            ),
            (
                GrammarSpec::Choice(vec![]),
                "choice: the list of choices is empty",
            ),
            (
                GrammarSpec::Grammar(" ".into()),
                "grammar: the grammar is empty",
            ),
        ];
        for (spec, expected) in cases {
            let err = spec
                .to_grammar(&ParserLimits::default())
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(expected), "{spec:?}: {err}");
        }
    }

    #[test]
    fn refuses_what_is_sure_to_be_past_the_limits_before_compiling() {
        let limits = ParserLimits::default(); // 2000 items in a row
        let many = |n: usize| (0..n).map(|i| format!("w{i}")).collect::<Vec<_>>();
        assert!(GrammarSpec::Choice(many(1999)).to_grammar(&limits).is_ok());
        let err = GrammarSpec::Choice(many(2000)).to_grammar(&limits);
        let err = err.unwrap_err().to_string();
        assert!(
            err.starts_with("choice: 2000 strings is too many: at most 1999"),
            "{err}"
        );
        let object = |n: usize, required: usize| {
            let properties: serde_json::Map<String, Value> =
                many(n).into_iter().map(|p| (p, json!({}))).collect();
            json!({"properties": properties, "required": many(required)})
        };
        let spec = |schema: Value| GrammarSpec::Json(schema.to_string());
        assert!(spec(object(2500, 1500)).to_grammar(&limits).is_ok());
        let nested = json!({"items": {"anyOf": [object(1001, 0)]}});
        let err = spec(nested).to_grammar(&limits).unwrap_err().to_string();
        assert!(
            err.starts_with("json: an object with 1001 optional properties"),
            "{err}"
        );
        let data = json!({"const": object(2001, 0), "examples": [object(2001, 0)]});
        assert!(spec(data).to_grammar(&limits).is_ok());
        let long = format!("start: \"{}\"", "a".repeat(MAX_SOURCE_BYTES));
        let err = GrammarSpec::Grammar(long).to_grammar(&limits);
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("bytes is too long: at most 262144"));
    }

    #[test]
    fn choices_are_quoted_lark_literals() {
        let lark = choice_lark(&["yes".into(), "a \"b\"\n".into()]);
        assert_eq!(lark, "start: \"yes\" | \"a \\\"b\\\"\\n\"\n");
    }

    #[test]
    fn schemas_get_compact_layout_unless_they_choose() {
        let s = compact(json!({"type": "object"})).unwrap();
        assert_eq!(s["x-guidance"]["whitespace_flexible"], json!(false));
        let own = json!({"type": "object", "x-guidance": {"whitespace_flexible": true}});
        assert_eq!(compact(own.clone()).unwrap(), own);
        assert_eq!(
            compact(json!(true)).unwrap()["x-guidance"]["item_separator"],
            ","
        );
    }
}
