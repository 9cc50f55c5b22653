//! The JSON Schema of `pipelines.toml` (`idem schema`), generated from the tables' types.

use super::PipelinesFile;

/// The JSON Schema of `pipelines.toml` (`idem schema`), for editors: every table and key with
/// its type and description. Defaults are stated in the descriptions (the generated ones
/// would show durations in their Rust form).
pub fn json_schema() -> serde_json::Value {
    fn strip_defaults(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(object) => {
                object.remove("default");
                object.values_mut().for_each(strip_defaults);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(strip_defaults),
            _ => {}
        }
    }
    let mut schema = schemars::schema_for!(PipelinesFile).to_value();
    strip_defaults(&mut schema);
    schema
}
