//! Effect values bound to a statement's parameter types: the conversion of each value kind
//! to each PostgreSQL type a parameter may have, found before anything is sent. A value
//! that does not bind is a `BindError`: the catalog finds it at planning (`statement`), and a
//! session's flight carries it when its types changed under a running host (`session`).

use bytes::BytesMut;
use chrono::{DateTime, NaiveDateTime, Utc};
use tokio_postgres::types::{IsNull, ToSql, Type};

use crate::effect::Value;

/// A value that does not bind to the parameter type a session's statement declares, found
/// before anything is sent. A change of the schema under a running host is the operator's
/// doing: a type the value's kind cannot bind to is a configuration fault (SQLSTATE 42804,
/// the pipeline pauses), a value out of the new type's range is the message's (22003).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BindError {
    #[error(
        "statement {statement:?} parameter ${index} is {now} on the server now ({was} when the host prepared it); the effect's {given} value does not bind to it: change the column back or the plugin and the statement to match"
    )]
    Type {
        statement: String,
        index: usize,
        was: &'static str,
        now: String,
        given: &'static str,
    },
    #[error("statement {statement:?} parameter ${index} ({now} on the server now): {problem}")]
    Value {
        statement: String,
        index: usize,
        now: &'static str,
        problem: String,
    },
}

impl BindError {
    /// The SQLSTATE the server would have raised, so `fault` classifies it as the server's.
    pub fn sqlstate(&self) -> &'static str {
        match self {
            BindError::Type { .. } => "42804",
            BindError::Value { .. } => "22003",
        }
    }
}

/// Parameter types idem can bind from plugin values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ParamType {
    Bool,
    Int2,
    Int4,
    Int8,
    Float4,
    Float8,
    Text,
    Jsonb,
    Bytea,
    Timestamptz,
    Timestamp,
    Uuid,
}

#[derive(Debug, Clone)]
pub struct BoundValue(Bound);

#[derive(Debug, Clone)]
pub(super) enum Bound {
    Bool(Option<bool>),
    Int2(Option<i16>),
    Int4(Option<i32>),
    Int8(Option<i64>),
    Float4(Option<f32>),
    Float8(Option<f64>),
    Text(Option<String>),
    Jsonb(Option<serde_json::Value>),
    Bytea(Option<Vec<u8>>),
    Timestamptz(Option<DateTime<Utc>>),
    Timestamp(Option<NaiveDateTime>),
    Uuid(Option<uuid::Uuid>),
}

/// `values` as the driver binds them, in parameter order.
pub fn values_as_params(values: &[BoundValue]) -> Vec<&(dyn ToSql + Sync)> {
    values
        .iter()
        .map(|value| value as &(dyn ToSql + Sync))
        .collect()
}

impl BoundValue {
    /// The value as its own Rust type, which the driver encodes.
    fn value(&self) -> &(dyn ToSql + Sync) {
        match &self.0 {
            Bound::Bool(value) => value,
            Bound::Int2(value) => value,
            Bound::Int4(value) => value,
            Bound::Int8(value) => value,
            Bound::Float4(value) => value,
            Bound::Float8(value) => value,
            Bound::Text(value) => value,
            Bound::Jsonb(value) => value,
            Bound::Bytea(value) => value,
            Bound::Timestamptz(value) => value,
            Bound::Timestamp(value) => value,
            Bound::Uuid(value) => value,
        }
    }

    /// The parameter type the value was bound for.
    pub(super) fn param_type(&self) -> ParamType {
        match &self.0 {
            Bound::Bool(_) => ParamType::Bool,
            Bound::Int2(_) => ParamType::Int2,
            Bound::Int4(_) => ParamType::Int4,
            Bound::Int8(_) => ParamType::Int8,
            Bound::Float4(_) => ParamType::Float4,
            Bound::Float8(_) => ParamType::Float8,
            Bound::Text(_) => ParamType::Text,
            Bound::Jsonb(_) => ParamType::Jsonb,
            Bound::Bytea(_) => ParamType::Bytea,
            Bound::Timestamptz(_) => ParamType::Timestamptz,
            Bound::Timestamp(_) => ParamType::Timestamp,
            Bound::Uuid(_) => ParamType::Uuid,
        }
    }
}

/// Each value is written by its own Rust type's encoding, which checks it against the
/// parameter's type; the catalog chose that Rust type from the type the server inferred.
impl ToSql for BoundValue {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        self.value().to_sql_checked(ty, out)
    }

    /// Any type: `to_sql` checks the value's own type against it.
    fn accepts(_ty: &Type) -> bool {
        true
    }

    tokio_postgres::types::to_sql_checked!();
}

pub(super) enum Conversion {
    WrongType,
    BadValue(String),
}

impl ParamType {
    /// The type a value binds as when the server's is not known.
    pub(super) fn natural(value: &Value) -> ParamType {
        match value {
            Value::Null | Value::Text(_) => ParamType::Text,
            Value::Boolean(_) => ParamType::Bool,
            Value::Integer(_) => ParamType::Int8,
            Value::Float(_) => ParamType::Float8,
            Value::Json(_) => ParamType::Jsonb,
            Value::Bytes(_) => ParamType::Bytea,
            Value::Timestamp(_) => ParamType::Timestamptz,
        }
    }

    /// The type of a parameter as a session's statement declares it.
    pub(super) fn of_wire(wire: &Type) -> Option<ParamType> {
        Some(match *wire {
            Type::BOOL => ParamType::Bool,
            Type::INT2 => ParamType::Int2,
            Type::INT4 => ParamType::Int4,
            Type::INT8 => ParamType::Int8,
            Type::FLOAT4 => ParamType::Float4,
            Type::FLOAT8 => ParamType::Float8,
            Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME => ParamType::Text,
            Type::JSON | Type::JSONB => ParamType::Jsonb,
            Type::BYTEA => ParamType::Bytea,
            Type::TIMESTAMPTZ => ParamType::Timestamptz,
            Type::TIMESTAMP => ParamType::Timestamp,
            Type::UUID => ParamType::Uuid,
            _ => return None,
        })
    }

    /// The SQL name of the type.
    pub(super) fn name(self) -> &'static str {
        match self {
            ParamType::Bool => "bool",
            ParamType::Int2 => "int2",
            ParamType::Int4 => "int4",
            ParamType::Int8 => "int8",
            ParamType::Float4 => "float4",
            ParamType::Float8 => "float8",
            ParamType::Text => "text",
            ParamType::Jsonb => "jsonb",
            ParamType::Bytea => "bytea",
            ParamType::Timestamptz => "timestamptz",
            ParamType::Timestamp => "timestamp",
            ParamType::Uuid => "uuid",
        }
    }

    /// Types that take the same kinds of plugin value and differ only in range or
    /// precision share a family.
    pub(super) fn family(self) -> u8 {
        match self {
            ParamType::Int2 | ParamType::Int4 | ParamType::Int8 => 1,
            ParamType::Float4 | ParamType::Float8 => 2,
            ParamType::Timestamptz | ParamType::Timestamp => 3,
            ParamType::Bool => 4,
            ParamType::Text => 5,
            ParamType::Jsonb => 6,
            ParamType::Bytea => 7,
            ParamType::Uuid => 8,
        }
    }

    /// The type the server declares for such a parameter.
    pub(super) fn wire_type(self) -> Type {
        match self {
            ParamType::Bool => Type::BOOL,
            ParamType::Int2 => Type::INT2,
            ParamType::Int4 => Type::INT4,
            ParamType::Int8 => Type::INT8,
            ParamType::Float4 => Type::FLOAT4,
            ParamType::Float8 => Type::FLOAT8,
            ParamType::Text => Type::TEXT,
            ParamType::Jsonb => Type::JSONB,
            ParamType::Bytea => Type::BYTEA,
            ParamType::Timestamptz => Type::TIMESTAMPTZ,
            ParamType::Timestamp => Type::TIMESTAMP,
            ParamType::Uuid => Type::UUID,
        }
    }

    /// The plugin value kinds this parameter accepts, for error messages.
    pub(super) fn expected(self) -> &'static str {
        match self {
            ParamType::Bool => "boolean (bool)",
            ParamType::Int2 => "integer (int2)",
            ParamType::Int4 => "integer (int4)",
            ParamType::Int8 => "integer (int8)",
            ParamType::Float4 => "float or integer (float4)",
            ParamType::Float8 => "float or integer (float8)",
            ParamType::Text => "text",
            ParamType::Jsonb => "json",
            ParamType::Bytea => "bytes (bytea)",
            ParamType::Timestamptz => "timestamp (timestamptz)",
            ParamType::Timestamp => "timestamp (timestamp)",
            ParamType::Uuid => "text holding a UUID (uuid)",
        }
    }

    pub(super) fn convert(self, value: &Value) -> Result<BoundValue, Conversion> {
        let out_of_range = |integer: i64| {
            Conversion::BadValue(format!("{integer} is out of range for {}", self.expected()))
        };
        Ok(BoundValue(match (self, value) {
            (ParamType::Bool, Value::Null) => Bound::Bool(None),
            (ParamType::Int2, Value::Null) => Bound::Int2(None),
            (ParamType::Int4, Value::Null) => Bound::Int4(None),
            (ParamType::Int8, Value::Null) => Bound::Int8(None),
            (ParamType::Float4, Value::Null) => Bound::Float4(None),
            (ParamType::Float8, Value::Null) => Bound::Float8(None),
            (ParamType::Text, Value::Null) => Bound::Text(None),
            (ParamType::Jsonb, Value::Null) => Bound::Jsonb(None),
            (ParamType::Bytea, Value::Null) => Bound::Bytea(None),
            (ParamType::Timestamptz, Value::Null) => Bound::Timestamptz(None),
            (ParamType::Timestamp, Value::Null) => Bound::Timestamp(None),
            (ParamType::Uuid, Value::Null) => Bound::Uuid(None),
            (ParamType::Bool, Value::Boolean(flag)) => Bound::Bool(Some(*flag)),
            (ParamType::Int2, Value::Integer(integer)) => Bound::Int2(Some(
                i16::try_from(*integer).map_err(|_| out_of_range(*integer))?,
            )),
            (ParamType::Int4, Value::Integer(integer)) => Bound::Int4(Some(
                i32::try_from(*integer).map_err(|_| out_of_range(*integer))?,
            )),
            (ParamType::Int8, Value::Integer(integer)) => Bound::Int8(Some(*integer)),
            (ParamType::Float4, Value::Float(float)) => Bound::Float4(Some(*float as f32)),
            (ParamType::Float4, Value::Integer(integer)) => Bound::Float4(Some(*integer as f32)),
            (ParamType::Float8, Value::Float(float)) => Bound::Float8(Some(*float)),
            (ParamType::Float8, Value::Integer(integer)) => Bound::Float8(Some(*integer as f64)),
            (ParamType::Text, Value::Text(text)) => {
                if text.contains('\0') {
                    return Err(Conversion::BadValue(
                        "text contains a NUL character, which Postgres cannot store".into(),
                    ));
                }
                Bound::Text(Some(text.clone()))
            }
            (ParamType::Jsonb, Value::Json(text)) => {
                Bound::Jsonb(Some(serde_json::from_str(text).map_err(|error| {
                    Conversion::BadValue(format!("invalid JSON: {error}"))
                })?))
            }
            (ParamType::Bytea, Value::Bytes(bytes)) => Bound::Bytea(Some(bytes.clone())),
            (ParamType::Timestamptz, Value::Timestamp(micros)) => {
                Bound::Timestamptz(Some(timestamp(*micros)?))
            }
            (ParamType::Timestamp, Value::Timestamp(micros)) => {
                Bound::Timestamp(Some(timestamp(*micros)?.naive_utc()))
            }
            (ParamType::Uuid, Value::Text(text)) => {
                Bound::Uuid(Some(uuid::Uuid::parse_str(text).map_err(|error| {
                    Conversion::BadValue(format!("invalid UUID: {error}"))
                })?))
            }
            _ => return Err(Conversion::WrongType),
        }))
    }
}

pub(super) fn timestamp(micros: i64) -> Result<DateTime<Utc>, Conversion> {
    DateTime::from_timestamp_micros(micros).ok_or_else(|| {
        Conversion::BadValue(format!(
            "{micros} microseconds is out of the timestamp range"
        ))
    })
}
