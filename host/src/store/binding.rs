//! A value that does not bind to its parameter's type, found before anything is sent: the
//! catalog finds it (`statement`), and a session's flight carries it (`session`).

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
