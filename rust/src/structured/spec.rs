//! What a request constrains its output to, and the llguidance grammar for it.

use llguidance::api::TopLevelGrammar;
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

    /// The llguidance grammar; malformed JSON, a non-schema or an empty choice list is
    /// refused here, the rest when the grammar is compiled.
    pub fn to_grammar(&self) -> Result<TopLevelGrammar> {
        let invalid = |m: String| CoreError::InvalidArgument(format!("{}: {m}", self.kind()));
        Ok(match self {
            GrammarSpec::Json(text) => {
                let schema: Value = serde_json::from_str(text)
                    .map_err(|e| invalid(format!("the schema is not valid JSON: {e}")))?;
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
            let err = spec.to_grammar().unwrap_err().to_string();
            assert!(err.starts_with(expected), "{spec:?}: {err}");
        }
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
