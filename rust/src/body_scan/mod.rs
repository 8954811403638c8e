//! A request body's longest texts, found without the Python interpreter.
//!
//! The server refuses a prompt whose UTF-8 length proves it can never fit the model's context.
//! Doing that after `json.loads` costs tens of milliseconds per 4 MB body with the GIL held,
//! which stalls the engine thread; `oversize_text` parses the body here (the binding releases
//! the GIL) and reports the first text of one top-level field past the byte limit, so such a
//! body is refused without being parsed in Python.

#[cfg(feature = "python")]
pub(crate) mod py;

use serde_json::Value;

/// The first text of a body's field whose UTF-8 length is past the limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Oversize {
    /// The body's top-level `model` string, if it has one (the server checks it first).
    pub model: Option<String>,
    /// The text's place in the field's list; None for a lone string or a list of one.
    pub index: Option<usize>,
    /// Its length in UTF-8 bytes.
    pub size: usize,
}

/// `body`'s first text in its top-level `field` (a string, or a list of strings) longer than
/// `limit` UTF-8 bytes. None when there is none, and whenever the body is not a JSON object
/// that strict JSON parsing takes (not UTF-8, a lone surrogate, NaN, nesting past 128): the
/// caller then parses it as it always does, so the answer is never a guess.
pub fn oversize_text(body: &[u8], field: &str, limit: usize) -> Option<Oversize> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let object = value.as_object()?;
    let (index, size) = match object.get(field)? {
        Value::String(text) => (None, text.len()),
        Value::Array(items) => {
            let mut sizes = Vec::with_capacity(items.len());
            for item in items {
                sizes.push(item.as_str()?.len()); // a list of token ids or mixed: not texts
            }
            let first = sizes.iter().position(|&size| size > limit)?;
            ((sizes.len() > 1).then_some(first), sizes[first])
        }
        _ => return None,
    };
    if size <= limit {
        return None;
    }
    let model = object
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_owned);
    Some(Oversize { model, index, size })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(body: &str, limit: usize) -> Option<Oversize> {
        oversize_text(body.as_bytes(), "prompt", limit)
    }

    #[test]
    fn a_lone_string_past_the_limit_is_found() {
        let found = scan(r#"{"model":"m","prompt":"abcdef"}"#, 5).unwrap();
        assert_eq!(
            found,
            Oversize {
                model: Some("m".into()),
                index: None,
                size: 6
            }
        );
        assert_eq!(scan(r#"{"prompt":"abcde"}"#, 5), None); // at the limit: it may fit
    }

    #[test]
    fn sizes_are_utf8_bytes_of_the_decoded_text() {
        // "é" is 2 bytes in UTF-8 whether written raw or as an escape; "\n" is one byte.
        assert_eq!(scan(r#"{"prompt":"\u00e9\u00e9\n"}"#, 4).unwrap().size, 5);
        assert_eq!(scan("{\"prompt\":\"\u{e9}\u{e9}\"}", 4), None);
        assert_eq!(scan(r#"{"prompt":"\ud83d\ude00"}"#, 3).unwrap().size, 4); // a pair: 4
    }

    #[test]
    fn a_list_reports_its_first_text_past_the_limit() {
        let found = scan(r#"{"prompt":["ab","abcdef","abcdefgh"]}"#, 5).unwrap();
        assert_eq!((found.index, found.size, found.model), (Some(1), 6, None));
        assert_eq!(scan(r#"{"prompt":["abcdef"]}"#, 5).unwrap().index, None);
        assert_eq!(scan(r#"{"prompt":["ab","cd"]}"#, 1).unwrap().index, Some(0));
    }

    #[test]
    fn anything_but_texts_in_strict_json_is_left_to_the_caller() {
        assert_eq!(scan(r#"{"prompt":[[1,2,3]]}"#, 0), None);
        assert_eq!(scan(r#"{"prompt":["abcdef",1]}"#, 0), None);
        assert_eq!(scan(r#"{"prompt":7}"#, 0), None);
        assert_eq!(scan(r#"{"input":"abcdef"}"#, 0), None);
        assert_eq!(scan(r#"["abcdef"]"#, 0), None);
        assert_eq!(scan(r#"{"prompt":"abcdef""#, 0), None); // cut short
        assert_eq!(scan(r#"{"prompt":"\ud800abcdef"}"#, 0), None); // a lone surrogate
        assert_eq!(scan(r#"{"prompt":"abcdef","t":NaN}"#, 0), None);
        assert_eq!(
            oversize_text(b"{\"prompt\":\"\xff\xfe\"}", "prompt", 0),
            None
        );
    }

    #[test]
    fn a_repeated_key_counts_as_its_last_value_as_in_python() {
        assert_eq!(scan(r#"{"prompt":"abcdef","prompt":"a"}"#, 2), None);
        assert_eq!(
            scan(r#"{"prompt":"a","prompt":"abcdef"}"#, 2).unwrap().size,
            6
        );
    }
}
