//! The Hugging Face files beside `tokenizer.json`: `tokenizer_config.json`, `chat_template.jinja`
//! and `generation_config.json`. Each is optional; a malformed one is an error naming the file.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::error::{Result, TextError};

/// Special-token attributes that transformers puts in a chat template's context.
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizerConfig {
    /// `(name, content)` for each special token named in `tokenizer_config.json`.
    pub special_tokens: Vec<(String, String)>,
    pub add_bos_token: Option<bool>,
    pub chat_template: Option<String>,
    /// From `generation_config.json`.
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

impl TokenizerConfig {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let mut config = TokenizerConfig::default();
        if let Some(json) = read_json(&dir.join("tokenizer_config.json"))? {
            config.read_tokenizer_config(&json, &dir.join("tokenizer_config.json"))?;
        }
        let jinja = dir.join("chat_template.jinja");
        if let Some(template) = read_optional(&jinja)? {
            config.chat_template = Some(template);
        }
        let generation = dir.join("generation_config.json");
        if let Some(json) = read_json(&generation)? {
            config.eos_token_ids = token_ids(&json, "eos_token_id", &generation)?;
            config.bos_token_id = token_ids(&json, "bos_token_id", &generation)?
                .first()
                .copied();
        }
        Ok(config)
    }

    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, content)| content.as_str())
    }

    fn read_tokenizer_config(&mut self, json: &Value, path: &Path) -> Result<()> {
        for key in SPECIAL_TOKEN_KEYS {
            match json.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::String(content)) => {
                    self.special_tokens.push((key.to_string(), content.clone()))
                }
                Some(Value::Object(token)) => match token.get("content") {
                    Some(Value::String(content)) => {
                        self.special_tokens.push((key.to_string(), content.clone()))
                    }
                    _ => {
                        return Err(parse_error(
                            path,
                            format!("{key} has no string \"content\""),
                        ))
                    }
                },
                Some(_) => return Err(parse_error(path, format!("{key} is not a string"))),
            }
        }
        self.add_bos_token = match json.get("add_bos_token") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(add)) => Some(*add),
            Some(_) => return Err(parse_error(path, "add_bos_token is not a bool".into())),
        };
        self.chat_template = match json.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(template)) => Some(template.clone()),
            Some(Value::Array(named)) => default_template(named, path)?,
            Some(_) => {
                return Err(parse_error(
                    path,
                    "chat_template is neither a string nor a list".into(),
                ))
            }
        };
        Ok(())
    }
}

/// A list of `{"name": ..., "template": ...}`: transformers uses the one named "default".
fn default_template(named: &[Value], path: &Path) -> Result<Option<String>> {
    for entry in named {
        let (Some(Value::String(name)), Some(Value::String(template))) =
            (entry.get("name"), entry.get("template"))
        else {
            return Err(parse_error(
                path,
                "chat_template list entries need string \"name\" and \"template\"".into(),
            ));
        };
        if name == "default" {
            return Ok(Some(template.clone()));
        }
    }
    Ok(None)
}

/// `key` as one id or a list of ids; absent or null is an empty list.
fn token_ids(json: &Value, key: &str, path: &Path) -> Result<Vec<u32>> {
    let as_id = |value: &Value| {
        value
            .as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(|| parse_error(path, format!("{key} holds {value}, not a token id")))
    };
    match json.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(ids)) => ids.iter().map(as_id).collect(),
        Some(id) => Ok(vec![as_id(id)?]),
    }
}

fn read_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TextError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    let Some(text) = read_optional(path)? else {
        return Ok(None);
    };
    let json: Value =
        serde_json::from_str(&text).map_err(|err| parse_error(path, err.to_string()))?;
    if !json.is_object() {
        return Err(parse_error(path, "expected a JSON object".into()));
    }
    Ok(Some(json))
}

fn parse_error(path: &Path, message: String) -> TextError {
    TextError::Parse {
        path: PathBuf::from(path),
        message,
    }
}
