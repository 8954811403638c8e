//! Chat templates rendered as transformers' `apply_chat_template(..., tokenize=False)` does:
//! jinja2 with `trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`,
//! a `tojson` that keeps non-ASCII text, and Python's string and dict methods (minijinja's
//! pycompat). Values print as Python prints them (`True`, `None`, `['a']`).

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Output, State};
use serde_json::{Map, Value as Json};

use super::error::{Result, TextError};
use super::python_format::{json_dumps, python_repr, JsonStyle};
use super::strftime::strftime_now;
use super::template_value::{from_template_value, to_template_value};

const TEMPLATE_NAME: &str = "chat_template";

/// Names a message's reasoning goes by; transformers fills the first two from any of them.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

pub struct ChatTemplate {
    env: Environment<'static>,
}

impl ChatTemplate {
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(python_methods);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env.add_template_owned(TEMPLATE_NAME, without_generation_tags(source))?;
        Ok(ChatTemplate { env })
    }

    /// `messages` is a list of `{"role", "content", ...}`; `extra` holds the other template
    /// variables (`bos_token`, `eos_token`, `tools`, `documents`, ...).
    pub fn render(
        &self,
        messages: &Json,
        add_generation_prompt: bool,
        extra: &Map<String, Json>,
    ) -> Result<String> {
        let mut context = extra.clone();
        context.entry("tools").or_insert(Json::Null);
        context.entry("documents").or_insert(Json::Null);
        context.insert("messages".into(), normalize_messages(messages)?);
        context.insert("add_generation_prompt".into(), add_generation_prompt.into());
        let template = self.env.get_template(TEMPLATE_NAME)?;
        Ok(template.render(to_template_value(&Json::Object(context)))?)
    }
}

/// transformers' `{% generation %}...{% endgeneration %}` marks assistant text for training masks
/// and renders its body unchanged: here it becomes an `if true` block with the same trimming.
fn without_generation_tags(source: &str) -> String {
    let mut source = source.to_string();
    for (open, close) in [("{%", "%}"), ("{%-", "%}"), ("{%", "-%}"), ("{%-", "-%}")] {
        for (tag, replacement) in [("generation", "if true"), ("endgeneration", "endif")] {
            source = source.replace(
                &format!("{open} {tag} {close}"),
                &format!("{open} {replacement} {close}"),
            );
        }
    }
    source
}

/// What transformers does before rendering: drop keys whose value is null (templates handle
/// a missing key better than `None`), and copy a message's reasoning under its common names.
fn normalize_messages(messages: &Json) -> Result<Json> {
    let Json::Array(messages) = messages else {
        return Err(TextError::InvalidArgument(
            "chat messages must be a list".into(),
        ));
    };
    let normalized = messages
        .iter()
        .map(|message| {
            let Json::Object(message) = message else {
                return Err(TextError::InvalidArgument(format!(
                    "a chat message must be an object, got {message}"
                )));
            };
            let reasoning = REASONING_FIELDS
                .iter()
                .find_map(|key| message.get(*key).filter(|v| !v.is_null()));
            let mut out = Map::new();
            if let Some(reasoning) = reasoning {
                out.insert("thinking".into(), reasoning.clone());
            }
            for (key, value) in message.iter().filter(|(_, v)| !v.is_null()) {
                out.insert(key.clone(), value.clone());
            }
            if let Some(reasoning) = reasoning {
                out.insert("reasoning_content".into(), reasoning.clone());
            }
            Ok(Json::Object(out))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Json::Array(normalized))
}

/// Python's `str`, `dict` and `list` methods, from minijinja's pycompat except where it differs
/// from CPython.
fn python_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, Error> {
    match (value.as_str(), method, args) {
        (Some(s), "title", []) => Ok(Value::from(python_title(s))),
        _ => minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args),
    }
}

/// `str.title()`: a cased letter is upper after an uncased character (a digit, an apostrophe).
fn python_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut after_cased = false;
    for c in s.chars() {
        if after_cased {
            out.extend(c.to_lowercase());
        } else {
            out.extend(c.to_uppercase());
        }
        after_cased = c.is_lowercase() || c.is_uppercase();
    }
    out
}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, as
/// transformers defines it: `json.dumps` without jinja2's HTML escaping.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) => {
            let n = i64::try_from(v)?;
            Some(" ".repeat(n.max(0) as usize))
        }
    };
    let mut style = JsonStyle::new(indent);
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    if let Some(separators) = &separators {
        let [item, key] = separators.as_slice() else {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson separators must be (item_separator, key_separator)",
            ));
        };
        style.item_separator = item;
        style.key_separator = key;
    }
    style.ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    style.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    Ok(Value::from(json_dumps(
        &from_template_value(value)?,
        &style,
    )))
}

/// jinja2 prints with `str()`: `True`, `None`, and containers as their Python repr.
fn python_formatter(
    out: &mut Output,
    state: &mut State,
    value: &Value,
) -> std::result::Result<(), Error> {
    let python = match value.kind() {
        ValueKind::Bool | ValueKind::None | ValueKind::Seq | ValueKind::Map => {
            python_repr(&from_template_value(value)?)
        }
        ValueKind::Number if !value.is_integer() => python_repr(&from_template_value(value)?),
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(&python).map_err(Error::from)
}

#[cfg(test)]
mod tests {
    use super::super::chat_template_parity::LLAMA2;
    use super::*;
    use serde_json::json;

    fn render(template: &str, messages: Json) -> Result<String> {
        ChatTemplate::new(template)?.render(&messages, false, &Map::new())
    }

    #[test]
    fn raise_exception_is_a_template_error_with_its_message() {
        let messages = json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]);
        let extra = json!({"bos_token": "<s>", "eos_token": "</s>"});
        let template = ChatTemplate::new(LLAMA2).unwrap();
        let err = template
            .render(&messages, false, extra.as_object().unwrap())
            .unwrap_err();
        assert!(matches!(err, TextError::Template(_)), "{err}");
        assert!(
            err.to_string()
                .contains("Conversation roles must alternate"),
            "{err}"
        );
    }

    #[test]
    fn syntax_and_render_errors_are_template_errors() {
        for bad in [
            "{% if %}",
            "{{ messages[0].content.nope() }}",
            "{% endfor %}",
        ] {
            let err = render(bad, json!([{"role": "user", "content": "x"}])).unwrap_err();
            assert!(matches!(err, TextError::Template(_)), "{bad}: {err}");
        }
    }

    #[test]
    fn generation_blocks_render_their_body() {
        let template = "{% for m in messages %}{%- generation -%}\n {{ m.content }} {% endgeneration %}\n!{% endfor %}";
        let messages = json!([{"role": "assistant", "content": "x"}]);
        // jinja2 with transformers' AssistantTracker gives the same.
        assert_eq!(render(template, messages).unwrap(), "x !");
    }

    #[test]
    fn messages_must_be_a_list_of_objects() {
        for bad in [json!({"role": "user"}), json!(["hello"])] {
            let err = render("{{ messages }}", bad).unwrap_err();
            assert!(matches!(err, TextError::InvalidArgument(_)), "{err}");
        }
    }

    #[test]
    fn null_keys_are_dropped_and_reasoning_is_aliased() {
        let messages = json!([{"role": "assistant", "content": null, "reasoning": "hmm"}]);
        let template = "{% for m in messages %}{{ m.content is defined }} {{ m.thinking }} \
                        {{ m.reasoning_content }} {{ m | length }}{% endfor %}";
        assert_eq!(render(template, messages).unwrap(), "False hmm hmm 4");
    }

    #[test]
    fn object_keys_keep_their_order() {
        let parsed: Map<String, Json> = serde_json::from_str(r#"{"b": 0, "a": 0}"#).unwrap();
        assert!(
            parsed.keys().eq(["b", "a"]),
            "serde_json sorts object keys: enable its \"preserve_order\" feature in Cargo.toml, \
             or templates see dict keys (tool schemas, message fields) in another order than Python"
        );
        let messages: Json =
            serde_json::from_str(r#"[{"role": "user", "content": "x", "b": 1, "a": 2}]"#).unwrap();
        let template = "{% for k in messages[0] %}{{ k }} {% endfor %}{{ messages[0] }}";
        assert_eq!(
            render(template, messages).unwrap(),
            "role content b a {'role': 'user', 'content': 'x', 'b': 1, 'a': 2}"
        );
    }

    #[test]
    fn strftime_now_formats_the_current_date() {
        let year = render("{{ strftime_now('%Y') }}", json!([])).unwrap();
        assert!(year.parse::<i32>().is_ok_and(|y| y >= 2024), "{year}");
        assert_eq!(
            super::super::strftime::strftime(
                "%d %b %Y %-d %B %A %H:%M:%S %j %I%p %%",
                1_709_251_199
            ),
            "29 Feb 2024 29 February Thursday 23:59:59 060 11PM %"
        );
    }
}
