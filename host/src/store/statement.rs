//! Named statements: prepared at start-up, and the only SQL a plugin's effects can run.
//!
//! Architecture invariant: a plugin names a statement and passes typed values; the host
//! checks the name, the parameter count and every value's type before a transaction opens.
//! The types are the server's as each session sees them: a session that prepared a
//! statement after a migration (`int4` widened to `int8`, say) gets its values bound again
//! for the new types before anything is sent (`BoundEffect::for_session`).

use std::collections::HashMap;
use std::sync::RwLock;

use tokio_postgres::types::{ToSql, Type};
use tracing::info;

use crate::config::PipelineConfig;
use crate::effect::Value;
use crate::store::binding::{BindError, BoundValue, Conversion, ParamType, values_as_params};
use crate::store::session::{Session, SessionError, SessionPool};

/// The statements of one pipeline, with the parameter types Postgres inferred for them.
#[derive(Debug)]
pub struct StatementCatalog {
    pipeline: String,
    statements: HashMap<String, PreparedStatement>,
}

#[derive(Debug)]
struct PreparedStatement {
    sql: String,
    params: Params,
}

/// What is known of a statement's parameters.
#[derive(Debug)]
enum Params {
    /// The types the server inferred when the statement was prepared, and since learned
    /// from sessions that prepared it after a compatible migration (see `learn`).
    Declared(RwLock<Vec<ParamType>>),
    /// Only their count, read from the SQL text (no database at hand): each value is checked
    /// as its own natural type (integer as int8, text as text, …).
    Counted(usize),
}

impl Params {
    fn len(&self) -> usize {
        match self {
            Params::Declared(types) => types.read().expect("parameter types").len(),
            Params::Counted(count) => *count,
        }
    }

    /// The type the value at `position` binds as (no copy of the list: `bind` asks once per
    /// value of every message).
    fn type_at(&self, position: usize, value: &Value) -> ParamType {
        match self {
            Params::Declared(types) => types.read().expect("parameter types")[position],
            Params::Counted(_) => ParamType::natural(value),
        }
    }

    /// The type each of `values` binds as.
    fn types_of(&self, values: &[Value]) -> Vec<ParamType> {
        match self {
            Params::Declared(types) => types.read().expect("parameter types").clone(),
            Params::Counted(_) => values.iter().map(ParamType::natural).collect(),
        }
    }

    /// Adopts `session`, the types a session's fresh prepare declared for `given`'s values,
    /// which all bound to them: later messages are checked against the server's types
    /// now. A parameter whose type changed family (`int8` to `jsonb`) is adopted only if its
    /// value was not null, so a null that binds to anything never teaches the catalog a type
    /// that would reject the next message's value as its own fault.
    fn learn(&self, statement: &str, session: &[ParamType], given: &[Value]) {
        let Params::Declared(types) = self else {
            return;
        };
        let mut types = types.write().expect("parameter types");
        if types.len() != session.len() || *types == session {
            return;
        }
        let adoptable = types
            .iter()
            .zip(session)
            .zip(given)
            .all(|((known, now), value)| {
                known.family() == now.family() || !matches!(value, Value::Null)
            });
        if !adoptable {
            return;
        }
        for (index, (known, now)) in types.iter().zip(session).enumerate() {
            if known != now {
                info!(
                    statement,
                    parameter = index + 1,
                    was = known.name(),
                    now = now.name(),
                    "A statement's parameter type changed on the server; values bind to the new type."
                );
            }
        }
        types.copy_from_slice(session);
    }
}

/// An effect checked against its statement, ready to bind.
#[derive(Debug, Clone)]
pub struct BoundEffect<'catalog> {
    pub statement: &'catalog str,
    pub sql: &'catalog str,
    params: &'catalog Params,
    /// The plugin's values, to bind again for a session that sees other types.
    given: &'catalog [Value],
    values: Vec<BoundValue>,
    /// A value out of range for the integer type the catalog knows, bound wider for the
    /// session to decide (see `bind`).
    out_of_range: Option<EffectError>,
}

/// A statement that cannot serve: refused at start-up and by `idem check`.
#[derive(Debug, thiserror::Error)]
pub enum StatementError {
    #[error(
        "pipeline {pipeline:?}, statement {statement:?}: does not prepare: {}",
        crate::store::fault::describe(source.as_ref())
    )]
    Prepare {
        pipeline: String,
        statement: String,
        source: Box<SessionError>,
    },
    #[error("pipeline {pipeline:?}: no session to prepare its statements on: {source}")]
    Session {
        pipeline: String,
        source: Box<SessionError>,
    },
    #[error(
        "pipeline {pipeline:?}, statement {statement:?}: parameter ${index} has type {type_name}, which idem cannot bind; cast it in the SQL, e.g. ${index}::int8 or ${index}::text"
    )]
    UnsupportedType {
        pipeline: String,
        statement: String,
        index: usize,
        type_name: String,
    },
}

/// Every statement of a pipeline that cannot serve, so `idem check` lists them all at once.
#[derive(Debug, thiserror::Error)]
#[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct StatementErrors(pub Vec<StatementError>);

/// An effect that does not fit its statement: the message is rejected, nothing runs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EffectError {
    #[error("effect names unknown statement {statement:?} (pipeline {pipeline:?} has: {known})")]
    UnknownStatement {
        pipeline: String,
        statement: String,
        known: String,
    },
    #[error("statement {statement:?} takes {expected} parameters, the effect gave {given}")]
    ParamCount {
        statement: String,
        expected: usize,
        given: usize,
    },
    #[error(
        "statement {statement:?} parameter ${index}: expected {expected}, the effect gave {given}"
    )]
    ParamType {
        statement: String,
        index: usize,
        expected: &'static str,
        given: &'static str,
    },
    #[error("statement {statement:?} parameter ${index}: {problem}")]
    ParamValue {
        statement: String,
        index: usize,
        problem: String,
    },
}

impl StatementCatalog {
    /// Prepares every statement of `pipeline` and records its parameter types; reports every
    /// statement that cannot serve, not only the first.
    pub async fn prepare(
        sessions: &SessionPool,
        pipeline: &PipelineConfig,
    ) -> Result<StatementCatalog, StatementErrors> {
        let mut session = sessions.acquire().await.map_err(|source| {
            StatementErrors(vec![StatementError::Session {
                pipeline: pipeline.name.clone(),
                source: Box::new(source),
            }])
        })?;
        let mut statements = HashMap::with_capacity(pipeline.statements.len());
        let mut errors = Vec::new();
        for (name, sql) in &pipeline.statements {
            match prepare_one(&mut session, pipeline, name, sql).await {
                Ok(params) => {
                    let prepared = PreparedStatement {
                        sql: sql.clone(),
                        params: Params::Declared(RwLock::new(params)),
                    };
                    statements.insert(name.clone(), prepared);
                }
                Err(error) => errors.push(error),
            }
        }
        if !errors.is_empty() {
            return Err(StatementErrors(errors));
        }
        Ok(StatementCatalog {
            pipeline: pipeline.name.clone(),
            statements,
        })
    }

    /// The statements of `pipeline` as its config declares them, without a database: names
    /// and parameter counts are checked, each value's type only against itself (`idem try`,
    /// `idem test` and `idem check --offline` when PostgreSQL is out of reach).
    pub fn from_config(pipeline: &PipelineConfig) -> StatementCatalog {
        let statements = pipeline
            .statements
            .iter()
            .map(|(name, sql)| {
                let prepared = PreparedStatement {
                    sql: sql.clone(),
                    params: Params::Counted(placeholder_count(sql)),
                };
                (name.clone(), prepared)
            })
            .collect();
        StatementCatalog {
            pipeline: pipeline.name.clone(),
            statements,
        }
    }

    /// Whether parameter types were checked against the server (false for
    /// [`StatementCatalog::from_config`]).
    pub fn types_known(&self) -> bool {
        self.statements
            .values()
            .all(|statement| matches!(statement.params, Params::Declared(_)))
    }

    /// Checks a call of `statement` with `params` against the statement and converts its
    /// values to the declared types.
    pub fn bind<'catalog>(
        &'catalog self,
        statement: &str,
        params: &'catalog [Value],
    ) -> Result<BoundEffect<'catalog>, EffectError> {
        let (name, prepared) = self.statements.get_key_value(statement).ok_or_else(|| {
            let mut known: Vec<&str> = self.statements.keys().map(String::as_str).collect();
            known.sort_unstable();
            EffectError::UnknownStatement {
                pipeline: self.pipeline.clone(),
                statement: statement.to_string(),
                known: known.join(", "),
            }
        })?;
        if params.len() != prepared.params.len() {
            return Err(EffectError::ParamCount {
                statement: name.clone(),
                expected: prepared.params.len(),
                given: params.len(),
            });
        }
        let mut out_of_range = None;
        let values = params
            .iter()
            .enumerate()
            .map(|(position, value)| {
                let param_type = prepared.params.type_at(position, value);
                let problem = match param_type.convert(value) {
                    Ok(bound) => return Ok(bound),
                    Err(problem) => problem,
                };
                let error = |problem| match problem {
                    Conversion::WrongType => EffectError::ParamType {
                        statement: name.clone(),
                        index: position + 1,
                        expected: param_type.expected(),
                        given: value.kind(),
                    },
                    Conversion::BadValue(problem) => EffectError::ParamValue {
                        statement: name.clone(),
                        index: position + 1,
                        problem,
                    },
                };
                match problem {
                    // Out of range for the integer type the catalog knows: the column may
                    // have been widened since. Bound as int8, the session decides on the
                    // server's type now (`for_session`).
                    Conversion::BadValue(_) if param_type.family() == ParamType::Int8.family() => {
                        out_of_range.get_or_insert(error(problem));
                        ParamType::Int8.convert(value).map_err(error)
                    }
                    problem => Err(error(problem)),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(BoundEffect {
            statement: name,
            sql: &prepared.sql,
            params: &prepared.params,
            given: params,
            values,
            out_of_range,
        })
    }
}

/// Prepares one statement and maps its parameter types.
async fn prepare_one(
    session: &mut Session,
    pipeline: &PipelineConfig,
    name: &str,
    sql: &str,
) -> Result<Vec<ParamType>, StatementError> {
    let types = session
        .parameter_types(sql)
        .await
        .map_err(|source| StatementError::Prepare {
            pipeline: pipeline.name.clone(),
            statement: name.to_string(),
            source: Box::new(source),
        })?;
    types
        .iter()
        .enumerate()
        .map(|(position, wire)| {
            ParamType::of_wire(wire).ok_or_else(|| StatementError::UnsupportedType {
                pipeline: pipeline.name.clone(),
                statement: name.to_string(),
                index: position + 1,
                type_name: wire.name().to_lowercase(),
            })
        })
        .collect()
}

impl BoundEffect<'_> {
    /// The values as the driver binds them, in parameter order.
    pub fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        values_as_params(&self.values)
    }

    /// A value out of range for the type the catalog knows: what a session that sees the
    /// same type refuses (`idem try` and `idem test` report it; `idem run` lets the
    /// server's type now decide).
    pub fn out_of_range(&self) -> Option<&EffectError> {
        self.out_of_range.as_ref()
    }

    /// The types of the values as bound: what an unnamed statement declares for them.
    pub fn types(&self) -> Vec<Type> {
        self.values
            .iter()
            .map(|value| value.param_type().wire_type())
            .collect()
    }

    /// Whether the values bound fit `types`, the parameter types a session's statement
    /// declares.
    pub fn fits(&self, types: &[Type]) -> bool {
        types.len() == self.values.len()
            && self
                .values
                .iter()
                .zip(types)
                .all(|(value, wire)| ParamType::of_wire(wire) == Some(value.param_type()))
    }

    /// The plugin's values bound again for `types`, the parameter types a session's
    /// statement declares when it was prepared just now: the server's types now, which
    /// differ from the catalog's after a migration. The catalog adopts them when every value
    /// binds (see `Params::learn`).
    pub fn for_session(&self, types: &[Type]) -> Result<Vec<BoundValue>, BindError> {
        let known = self.params.types_of(self.given);
        let mut session = Vec::with_capacity(types.len());
        let mut values = Vec::with_capacity(types.len());
        for (position, (value, wire)) in self.given.iter().zip(types).enumerate() {
            let was = known.get(position).map_or("unknown", |known| known.name());
            let Some(param_type) = ParamType::of_wire(wire) else {
                return Err(BindError::Type {
                    statement: self.statement.to_string(),
                    index: position + 1,
                    was,
                    now: wire.name().to_string(),
                    given: value.kind(),
                });
            };
            let bound = param_type.convert(value).map_err(|problem| match problem {
                Conversion::WrongType => BindError::Type {
                    statement: self.statement.to_string(),
                    index: position + 1,
                    was,
                    now: param_type.name().to_string(),
                    given: value.kind(),
                },
                Conversion::BadValue(problem) => BindError::Value {
                    statement: self.statement.to_string(),
                    index: position + 1,
                    now: param_type.name(),
                    problem,
                },
            })?;
            session.push(param_type);
            values.push(bound);
        }
        self.params.learn(self.statement, &session, self.given);
        Ok(values)
    }
}

/// How many parameters Postgres will see in `sql`: the highest `$n` outside string
/// literals, quoted identifiers, dollar-quoted bodies and comments.
pub fn placeholder_count(sql: &str) -> usize {
    let bytes = sql.as_bytes();
    let mut highest = 0;
    let mut index = 0;
    let skip_to = |from: usize, end: &[u8]| {
        bytes[from..]
            .windows(end.len())
            .position(|window| window == end)
            .map_or(bytes.len(), |offset| from + offset + end.len())
    };
    while index < bytes.len() {
        index = match bytes[index] {
            b'\'' => skip_to(index + 1, b"'"),
            b'"' => skip_to(index + 1, b"\""),
            b'-' if bytes.get(index + 1) == Some(&b'-') => skip_to(index + 2, b"\n"),
            b'/' if bytes.get(index + 1) == Some(&b'*') => skip_to(index + 2, b"*/"),
            b'$' => {
                let digits = bytes[index + 1..]
                    .iter()
                    .take_while(|byte| byte.is_ascii_digit())
                    .count();
                if digits > 0 {
                    let number = &sql[index + 1..index + 1 + digits];
                    highest = highest.max(number.parse().unwrap_or(usize::MAX));
                    index + 1 + digits
                } else {
                    // A dollar quote `$tag$ … $tag$` (tag: letters, digits, underscores).
                    let tag_length = bytes[index + 1..]
                        .iter()
                        .take_while(|byte| byte.is_ascii_alphanumeric() || **byte == b'_')
                        .count();
                    let close = index + 1 + tag_length;
                    let after_identifier = index > 0
                        && (bytes[index - 1].is_ascii_alphanumeric() || bytes[index - 1] == b'_');
                    if bytes.get(close) == Some(&b'$') && !after_identifier {
                        let tag = &bytes[index..=close];
                        skip_to(close + 1, tag)
                    } else {
                        index + 1
                    }
                }
            }
            _ => index + 1,
        };
    }
    highest
}

#[cfg(test)]
mod tests {
    use bytes::BytesMut;

    use super::*;

    fn catalog() -> StatementCatalog {
        let statement = |params: Vec<ParamType>| PreparedStatement {
            sql: String::new(),
            params: Params::Declared(RwLock::new(params)),
        };
        StatementCatalog {
            pipeline: "loyalty".into(),
            statements: HashMap::from([
                (
                    "credit".to_string(),
                    statement(vec![ParamType::Int8, ParamType::Int4]),
                ),
                (
                    "note".to_string(),
                    statement(vec![ParamType::Text, ParamType::Jsonb, ParamType::Uuid]),
                ),
                ("stamp".to_string(), statement(vec![ParamType::Timestamptz])),
            ]),
        }
    }

    #[track_caller]
    fn check(statement: &str, params: Vec<Value>, expected: Result<(), &str>) {
        let catalog = catalog();
        let bound = catalog
            .bind(statement, &params)
            .and_then(|bound| match bound.out_of_range() {
                Some(error) => Err(error.clone()),
                None => Ok(bound),
            });
        match (bound, expected) {
            (Ok(bound), Ok(())) => {
                assert_eq!(bound.statement, statement);
                let Params::Declared(types) = &catalog.statements[statement].params else {
                    panic!("declared types");
                };
                let types = types.read().expect("types").clone();
                for (value, param_type) in bound.params().iter().zip(types) {
                    let mut out = BytesMut::new();
                    value
                        .to_sql_checked(&param_type.wire_type(), &mut out)
                        .expect("the value encodes as its parameter type");
                }
            }
            (Err(error), Err(fragment)) => {
                let message = error.to_string();
                assert!(message.contains(fragment), "{message:?} lacks {fragment:?}");
            }
            (Ok(_), Err(fragment)) => panic!("expected an error containing {fragment:?}"),
            (Err(error), Ok(())) => panic!("unexpected error: {error}"),
        }
    }

    #[test]
    fn binding() {
        use Value::*;
        check("credit", vec![Integer(7), Integer(50)], Ok(()));
        check("credit", vec![Null, Null], Ok(()));
        check(
            "credit",
            vec![Integer(7)],
            Err("takes 2 parameters, the effect gave 1"),
        );
        check(
            "credit",
            vec![Text("7".into()), Integer(50)],
            Err("parameter $1: expected integer (int8), the effect gave text"),
        );
        check(
            "credit",
            vec![Integer(7), Integer(1 << 40)],
            Err("parameter $2: 1099511627776 is out of range"),
        );
        check(
            "debit",
            vec![],
            Err("unknown statement \"debit\" (pipeline \"loyalty\" has: credit, note, stamp)"),
        );
        check(
            "note",
            vec![
                Text("hi".into()),
                Json("{\"a\":1}".into()),
                Text("67e55044-10b1-426f-9247-bb680e5fe0c8".into()),
            ],
            Ok(()),
        );
        check(
            "note",
            vec![Text("hi".into()), Json("{".into()), Null],
            Err("parameter $2: invalid JSON"),
        );
        check(
            "note",
            vec![Text("a\0b".into()), Null, Null],
            Err("parameter $1: text contains a NUL"),
        );
        check(
            "note",
            vec![Null, Null, Text("not-a-uuid".into())],
            Err("parameter $3: invalid UUID"),
        );
        check("stamp", vec![Timestamp(1_700_000_000_000_000)], Ok(()));
        check(
            "stamp",
            vec![Timestamp(i64::MAX)],
            Err("out of the timestamp range"),
        );
    }

    /// The values of `effect` encoded for `types`, as the driver sends them.
    #[track_caller]
    fn encode(values: &[BoundValue], types: &[Type]) {
        for (value, wire) in values.iter().zip(types) {
            value
                .to_sql_checked(wire, &mut BytesMut::new())
                .unwrap_or_else(|error| panic!("{value:?} as {wire}: {error}"));
        }
    }

    /// After a widening migration a session declares wider types than the catalog: the
    /// values bind again for them, and the catalog adopts them, so a value only the wider
    /// type takes binds from then on.
    #[test]
    fn values_bind_again_for_the_types_a_session_declares() {
        let catalog = catalog();
        let given = [Value::Integer(7), Value::Integer(50)];
        let bound = catalog.bind("credit", &given).expect("binds");
        let widened = [Type::INT8, Type::INT8];
        assert!(bound.fits(&[Type::INT8, Type::INT4]));
        assert!(!bound.fits(&widened));
        let values = bound.for_session(&widened).expect("binds for int8");
        encode(&values, &widened);
        let big = [Value::Integer(7), Value::Integer(1 << 40)];
        let learned = catalog.bind("credit", &big).expect("binds");
        assert!(learned.out_of_range().is_none(), "{learned:?}");
        assert!(learned.fits(&widened));
        for (value, wire) in learned.params().into_iter().zip(&widened) {
            value
                .to_sql_checked(wire, &mut BytesMut::new())
                .expect("encodes as int8");
        }

        let stamp = [Value::Timestamp(1_700_000_000_000_000)];
        let bound = catalog.bind("stamp", &stamp).expect("binds");
        let values = bound.for_session(&[Type::TIMESTAMP]).expect("timestamp");
        encode(&values, &[Type::TIMESTAMP]);
        let text = [Value::Text("hi".into()), Value::Null, Value::Null];
        let bound = catalog.bind("note", &text).expect("binds");
        assert!(bound.fits(&[Type::VARCHAR, Type::JSON, Type::UUID]));
    }

    /// A type the value's kind does not bind to is named with both types; a value out of the
    /// session's range is the value's problem; a null teaches no change of family.
    #[test]
    fn a_session_type_the_value_cannot_bind_to_is_named() {
        let catalog = catalog();
        let given = [Value::Integer(7), Value::Integer(50)];
        let bound = catalog.bind("credit", &given).expect("binds");
        let error = bound
            .for_session(&[Type::INT8, Type::JSONB])
            .expect_err("an integer is no jsonb");
        assert_eq!(error.sqlstate(), "42804");
        let message = error.to_string();
        for fragment in ["\"credit\"", "$2", "jsonb", "int4", "integer"] {
            assert!(message.contains(fragment), "{message:?} lacks {fragment}");
        }
        let error = bound
            .for_session(&[Type::INT8, Type::NUMERIC])
            .expect_err("numeric is not bound");
        assert!(error.to_string().contains("numeric"), "{error}");

        let big = [Value::Integer(1 << 40), Value::Integer(1)];
        let bound = catalog.bind("credit", &big).expect("binds");
        let error = bound
            .for_session(&[Type::INT4, Type::INT4])
            .expect_err("out of int4's range");
        assert_eq!(error.sqlstate(), "22003");
        assert!(error.to_string().contains("out of range"), "{error}");

        let nulls = [Value::Null, Value::Null];
        let bound = catalog.bind("credit", &nulls).expect("binds");
        bound
            .for_session(&[Type::INT8, Type::JSONB])
            .expect("a null binds to anything");
        let again = catalog.bind("credit", &given).expect("still int4");
        assert!(again.fits(&[Type::INT8, Type::INT4]), "{again:?}");
    }

    #[test]
    fn placeholders_are_counted_outside_literals_and_comments() {
        for (sql, expected) in [
            ("SELECT 1", 0),
            ("UPDATE b SET p = p + $2 WHERE c = $1", 2),
            ("SELECT $1::int8, $1", 1),
            ("SELECT '$5', $1", 1),
            ("SELECT 'it''s $4', $2", 2),
            ("SELECT \"col$3\" FROM t WHERE a = $1", 1),
            ("SELECT $1 -- and $9\n, $2", 2),
            ("SELECT /* $7 */ $1", 1),
            ("SELECT $$ $8 $$, $tag$ $6 $tag$, $3", 3),
            ("SELECT a$1 FROM t", 1),
            ("SELECT $12", 12),
            ("SELECT '$1", 0),
        ] {
            assert_eq!(placeholder_count(sql), expected, "{sql}");
        }
    }

    #[test]
    fn a_catalog_from_config_checks_names_counts_and_values() {
        let config = crate::config::Config::from_toml(
            std::path::Path::new("/etc/idem/pipelines.toml"),
            r#"
            [database]
            url = "postgres://localhost/x"
            [amqp]
            url = "amqp://localhost"
            [pipelines.loyalty]
            queue = "orders"
            plugin = "x.wasm"
            [pipelines.loyalty.statements]
            credit = "UPDATE b SET p = p + $2 WHERE c = $1"
            "#,
        )
        .unwrap_or_else(|error| panic!("{error}"));
        let catalog = StatementCatalog::from_config(&config.pipelines[0]);
        assert!(!catalog.types_known());
        assert!(
            catalog
                .bind("credit", &[Value::Integer(7), Value::Integer(50)])
                .is_ok()
        );
        let error = catalog
            .bind("credit", &[Value::Integer(7)])
            .expect_err("one parameter short");
        assert!(
            error
                .to_string()
                .contains("takes 2 parameters, the effect gave 1")
        );
        let error = catalog.bind("debit", &[]).expect_err("no such statement");
        assert!(
            error
                .to_string()
                .contains("pipeline \"loyalty\" has: credit")
        );
        let error = catalog
            .bind("credit", &[Value::Text("a\0".into()), Value::Null])
            .expect_err("a NUL in text");
        assert!(error.to_string().contains("NUL"));
    }
}
