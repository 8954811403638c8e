//! A request body's longest texts, found without the Python interpreter.
//!
//! The server refuses a prompt whose UTF-8 length proves it can never fit the model's context.
//! Doing that after `json.loads` costs tens of milliseconds per 4 MB body with the GIL held,
//! which stalls the engine thread; `oversize_text` parses the body here (the binding releases
//! the GIL) and reports the first text of one top-level field past the byte limit, so such a
//! body is refused without being parsed in Python.

#[cfg(feature = "python")]
pub(crate) mod py;

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

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
/// caller then parses it as it always does, so the answer is never a guess. Nothing but the
/// field's texts' lengths and the model's name is kept: the rest is checked and skipped.
pub fn oversize_text(body: &[u8], field: &str, limit: usize) -> Option<Oversize> {
    let mut parser = serde_json::Deserializer::from_slice(body);
    let scanned = parser.deserialize_map(BodyVisitor { field, limit }).ok()?;
    parser.end().ok()?; // nothing but white space after the object
    let (index, size) = match scanned.texts? {
        Texts::One(size) => (size > limit).then_some((None, size))?,
        Texts::List { count, first_over } => {
            let (index, size) = first_over?;
            ((count > 1).then_some(index), size)
        }
        Texts::Other => return None,
    };
    Some(Oversize {
        model: scanned.model.flatten(),
        index,
        size,
    })
}

/// What a body's field holds, as far as texts go.
enum Texts {
    One(usize),
    List {
        count: usize,
        first_over: Option<(usize, usize)>,
    },
    Other,
}

/// The last value of each key of interest (JSON's repeated keys count as Python counts them).
struct Scanned {
    texts: Option<Texts>,
    model: Option<Option<String>>,
}

struct BodyVisitor<'f> {
    field: &'f str,
    limit: usize,
}

impl<'de> Visitor<'de> for BodyVisitor<'_> {
    type Value = Scanned;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Scanned, A::Error> {
        let mut scanned = Scanned {
            texts: None,
            model: None,
        };
        while let Some(key) = map.next_key::<String>()? {
            if key == self.field {
                scanned.texts = Some(map.next_value_seed(TextsSeed { limit: self.limit })?);
            } else if key == "model" {
                scanned.model = Some(map.next_value_seed(StrOr(str::to_owned))?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(scanned)
    }
}

struct TextsSeed {
    limit: usize,
}

impl<'de> DeserializeSeed<'de> for TextsSeed {
    type Value = Texts;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Texts, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TextsSeed {
    type Value = Texts;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E>(self, text: &str) -> Result<Texts, E> {
        Ok(Texts::One(text.len()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Texts, A::Error> {
        let (mut count, mut first_over, mut texts) = (0, None, true);
        while let Some(item) = seq.next_element_seed(StrOr(str::len))? {
            match item {
                Some(size) if first_over.is_none() && size > self.limit => {
                    first_over = Some((count, size))
                }
                Some(_) => {}
                None => texts = false, // token ids, or mixed: not texts
            }
            count += 1;
        }
        Ok(if texts {
            Texts::List { count, first_over }
        } else {
            Texts::Other
        })
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Texts, A::Error> {
        skip_map(map).map(|_| Texts::Other)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Texts, E> {
        Ok(Texts::Other)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Texts, E> {
        Ok(Texts::Other)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Texts, E> {
        Ok(Texts::Other)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Texts, E> {
        Ok(Texts::Other)
    }

    fn visit_unit<E>(self) -> Result<Texts, E> {
        Ok(Texts::Other)
    }
}

/// A JSON value: `Some(f(text))` for a string, None for anything else (checked and skipped).
struct StrOr<F>(F);

impl<'de, T, F: FnOnce(&str) -> T> DeserializeSeed<'de> for StrOr<F> {
    type Value = Option<T>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<T>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, T, F: FnOnce(&str) -> T> Visitor<'de> for StrOr<F> {
    type Value = Option<T>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E>(self, text: &str) -> Result<Option<T>, E> {
        Ok(Some((self.0)(text)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<T>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Option<T>, A::Error> {
        skip_map(map).map(|_| None)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Option<T>, E> {
        Ok(None)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Option<T>, E> {
        Ok(None)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Option<T>, E> {
        Ok(None)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Option<T>, E> {
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Option<T>, E> {
        Ok(None)
    }
}

fn skip_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
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
    fn everything_else_in_the_body_is_checked_and_skipped() {
        let body = r#"{"a":[1,{"b":[null,true,2.5e3,"x"]}],"model":["m"],"prompt":"abcdef"}"#;
        let found = scan(body, 5).unwrap();
        assert_eq!((found.model, found.size), (None, 6)); // a model that is not a string
        assert_eq!(scan(r#"{"prompt":"abcdef","a":[1,}"#, 5), None); // invalid after the text
        assert_eq!(scan(r#"{"prompt":"abcdef"} x"#, 5), None); // something after the object
        assert_eq!(scan("{\"prompt\":\"abcdef\"}\n\t ", 5).unwrap().size, 6);
        assert_eq!(scan(r#"{"pr\u006fmpt":"abcdef"}"#, 5).unwrap().size, 6); // an escaped key
        assert_eq!(scan(r#"{"prompt":["abcdef",{"a":1}]}"#, 5), None);
        assert_eq!(scan(r#"{"prompt":[]}"#, 0), None);
        assert_eq!(scan(r#"{"prompt":{"a":"abcdef"}}"#, 0), None);
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
