//! JSON values in and out of minijinja, keeping the order of object keys (Python dicts keep
//! insertion order, and templates print tool schemas key by key).

use std::sync::Arc;

use minijinja::value::{Enumerator, Object, ObjectRepr, Value, ValueKind};
use minijinja::{Error, ErrorKind};
use serde_json::{Map, Number, Value as Json};

/// A JSON object as a template sees it: a map whose keys iterate in their original order.
#[derive(Debug)]
struct OrderedMap(Vec<(String, Value)>);

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        let keys: Vec<Value> = self
            .0
            .iter()
            .map(|(k, _)| Value::from(k.as_str()))
            .collect();
        Enumerator::Iter(Box::new(keys.into_iter()))
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.len())
    }
}

pub fn to_template_value(json: &Json) -> Value {
    match json {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => Value::from(items.iter().map(to_template_value).collect::<Vec<_>>()),
        Json::Object(map) => Value::from_object(OrderedMap(
            map.iter()
                .map(|(k, v)| (k.clone(), to_template_value(v)))
                .collect(),
        )),
    }
}

pub fn from_template_value(value: &Value) -> Result<Json, Error> {
    Ok(match value.kind() {
        ValueKind::Undefined | ValueKind::None => Json::Null,
        ValueKind::Bool => Json::Bool(value.is_true()),
        ValueKind::Number if value.is_integer() => match i64::try_from(value.clone()) {
            Ok(i) => Json::from(i),
            Err(_) => Json::from(u64::try_from(value.clone())?),
        },
        ValueKind::Number => {
            let f = f64::try_from(value.clone())?;
            Number::from_f64(f).map_or(Json::Null, Json::Number)
        }
        ValueKind::String => Json::String(value.as_str().unwrap_or_default().to_string()),
        ValueKind::Seq | ValueKind::Iterable => Json::Array(
            value
                .try_iter()?
                .map(|item| from_template_value(&item))
                .collect::<Result<_, _>>()?,
        ),
        ValueKind::Map => {
            let mut map = Map::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                let key = match key.as_str() {
                    Some(s) => s.to_string(),
                    None => key.to_string(),
                };
                map.insert(key, from_template_value(&item)?);
            }
            Json::Object(map)
        }
        ValueKind::Bytes => Json::String(value.to_string()),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("cannot convert {} to JSON", value.kind()),
            ))
        }
    })
}
