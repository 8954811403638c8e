//! How Python prints values, for chat templates written against jinja2: `json.dumps` (which
//! transformers uses for `tojson`) and `repr` (what `{{ value }}` shows for lists, dicts, True).

use std::fmt::Write;

use serde_json::Value;

pub struct JsonStyle<'a> {
    pub indent: Option<String>,
    pub item_separator: &'a str,
    pub key_separator: &'a str,
    pub ensure_ascii: bool,
    pub sort_keys: bool,
}

impl JsonStyle<'_> {
    /// `json.dumps` defaults for the given indent: `", "` between items unless indented.
    pub fn new(indent: Option<String>) -> Self {
        let item_separator = if indent.is_some() { "," } else { ", " };
        JsonStyle {
            indent,
            item_separator,
            key_separator: ": ",
            ensure_ascii: false,
            sort_keys: false,
        }
    }
}

/// `json.dumps(value, ...)`.
pub fn json_dumps(value: &Value, style: &JsonStyle) -> String {
    let mut out = String::new();
    write_json(&mut out, value, style, 0);
    out
}

fn write_json(out: &mut String, value: &Value, style: &JsonStyle, depth: usize) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&json_number(n)),
        Value::String(s) => write_json_string(out, s, style.ensure_ascii),
        Value::Array(items) => {
            write_container(out, ('[', ']'), items.iter(), style, depth, |out, item| {
                write_json(out, item, style, depth + 1)
            })
        }
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            write_container(
                out,
                ('{', '}'),
                entries.into_iter(),
                style,
                depth,
                |out, (k, v)| {
                    write_json_string(out, k, style.ensure_ascii);
                    out.push_str(style.key_separator);
                    write_json(out, v, style, depth + 1);
                },
            )
        }
    }
}

fn write_container<T>(
    out: &mut String,
    (open, close): (char, char),
    items: impl ExactSizeIterator<Item = T>,
    style: &JsonStyle,
    depth: usize,
    mut write_item: impl FnMut(&mut String, T),
) {
    out.push(open);
    let empty = items.len() == 0;
    for (i, item) in items.enumerate() {
        if i > 0 {
            out.push_str(style.item_separator);
        }
        if let Some(indent) = &style.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth + 1));
        }
        write_item(out, item);
    }
    if let (Some(indent), false) = (&style.indent, empty) {
        out.push('\n');
        out.push_str(&indent.repeat(depth));
    }
    out.push(close);
}

fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn json_number(n: &serde_json::Number) -> String {
    match n.as_f64() {
        Some(f) if n.is_f64() => match f {
            f if f.is_nan() => "NaN".into(),
            f if f.is_infinite() => if f > 0.0 { "Infinity" } else { "-Infinity" }.into(),
            f => float_repr(f),
        },
        _ => n.to_string(),
    }
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form outside 1e-4 <= |x| < 1e16.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.into();
    }
    let sci = format!("{f:e}");
    let (mantissa, exponent) = sci.split_once('e').expect("{:e} has an exponent");
    let exponent: i32 = exponent.parse().expect("{:e} exponent is an integer");
    if (-4..16).contains(&exponent) {
        let plain = format!("{f}");
        if plain.contains('.') {
            plain
        } else {
            plain + ".0"
        }
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    }
}

/// Python's `repr` of a JSON-like value (`str()` of a container shows the items' repr).
pub fn python_repr(value: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, value);
    out
}

fn write_repr(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("None"),
        Value::Bool(b) => out.push_str(if *b { "True" } else { "False" }),
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() => out.push_str(&float_repr(f)),
            _ => out.push_str(&n.to_string()),
        },
        Value::String(s) => write_repr_string(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr_string(out, k);
                out.push_str(": ");
                write_repr(out, v);
            }
            out.push('}');
        }
    }
}

fn write_repr_string(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn floats_print_as_python_repr() {
        let cases = [
            (0.1, "0.1"),
            (3.0, "3.0"),
            (-0.0, "-0.0"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (123.456, "123.456"),
            (2.5e-10, "2.5e-10"),
            (f64::INFINITY, "inf"),
        ];
        for (f, python) in cases {
            assert_eq!(float_repr(f), python);
        }
    }

    #[test]
    fn json_dumps_matches_python() {
        // Expected strings from Python 3.11's json.dumps.
        let value =
            json!({"b": [1, 2.5, null, true], "a": "ü\"\\\n\u{1}\u{7f}😀", "e": {}, "l": []});
        let mut plain = JsonStyle::new(None);
        plain.sort_keys = true;
        assert_eq!(
            json_dumps(&value, &plain),
            r#"{"a": "ü\"\\\n\u0001\u007f😀", "b": [1, 2.5, null, true], "e": {}, "l": []}"#
                .replace("\\u007f", "\u{7f}")
        );
        let mut indented = JsonStyle::new(Some("  ".into()));
        indented.sort_keys = true;
        indented.ensure_ascii = true;
        assert_eq!(
            json_dumps(&value, &indented),
            "{\n  \"a\": \"\\u00fc\\\"\\\\\\n\\u0001\\u007f\\ud83d\\ude00\",\n  \"b\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"e\": {},\n  \"l\": []\n}"
        );
        let compact = JsonStyle {
            item_separator: ",",
            key_separator: ":",
            ..JsonStyle::new(None)
        };
        assert_eq!(
            json_dumps(&json!({"k": [1, 2]}), &compact),
            r#"{"k":[1,2]}"#
        );
    }

    #[test]
    fn repr_matches_python() {
        let value = json!(["it's", "say \"hi\"", "both '\"", "tab\t", null, false, 1e-7, {"k": 1}]);
        assert_eq!(
            python_repr(&value),
            r#"["it's", 'say "hi"', 'both \'"', 'tab\t', None, False, 1e-07, {'k': 1}]"#
        );
    }
}
