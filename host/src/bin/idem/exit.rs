//! How `idem` exits: one status per kind of outcome, the same for every command, so a
//! script, an init container or systemd tells a typo from an outage without reading the
//! words (docs/cli.md lists them; `RestartPreventExitStatus=3` in the systemd unit).

use std::process::ExitCode;

use idem_host::StartError;
use idem_host::config::ConfigError;
use idem_host::source::SourceError;
use idem_host::store::database::DatabaseError;
use idem_host::store::fault::{self, Fault, Origin};

/// A command's exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// 0: done; for a report, nothing wrong found.
    Success,
    /// 1: anything not below: an unexpected error, a drain past `--shutdown-timeout`, a
    /// migration that failed, a conversion refused while hosts are connected.
    Failure,
    /// 2: the command line is wrong: an unknown flag, a pipeline or database the config
    /// does not have.
    Usage,
    /// 3: the configuration is wrong, and no retry fixes it: the file unreadable or invalid,
    /// a setting a service refused (credentials, TLS, a queue declared otherwise), a plugin
    /// or statement that does not load, idem's tables missing.
    Config,
    /// 4: a database or broker could not be reached (or was busy): the same command later
    /// can succeed.
    Unavailable,
    /// 5: the command ran, and its answer is no: `check` found problems, a case of `test`
    /// failed, `try`'s outcome would be rejected, nothing matched what was asked for.
    Findings,
}

impl Exit {
    /// The status number.
    pub fn code(self) -> u8 {
        match self {
            Exit::Success => 0,
            Exit::Failure => 1,
            Exit::Usage => 2,
            Exit::Config => 3,
            Exit::Unavailable => 4,
            Exit::Findings => 5,
        }
    }

    /// The graver of two outcomes, for a report that found several: problems to fix in the
    /// configuration win over an outage (retrying will not help), which wins over success.
    pub fn worst(self, other: Exit) -> Exit {
        let rank = |exit: Exit| match exit {
            Exit::Success => 0,
            Exit::Unavailable => 1,
            Exit::Findings => 2,
            Exit::Failure => 3,
            Exit::Config => 4,
            Exit::Usage => 5,
        };
        if rank(other) > rank(self) {
            other
        } else {
            self
        }
    }

    /// What a command's error means, read from the first cause idem knows.
    pub fn of_error(error: &anyhow::Error) -> Exit {
        error
            .chain()
            .find_map(|cause| {
                if cause.is::<UsageError>() {
                    Some(Exit::Usage)
                } else if cause.is::<ConfigError>() {
                    Some(Exit::Config)
                } else if let Some(start) = cause.downcast_ref::<StartError>() {
                    Some(of_start(start))
                } else if let Some(database) = cause.downcast_ref::<DatabaseError>() {
                    Some(of_database(database))
                } else if let Some(source) = cause.downcast_ref::<SourceError>() {
                    Some(of_source(source))
                } else {
                    cause.downcast_ref::<sqlx::Error>().map(of_statement)
                }
            })
            .unwrap_or(Exit::Failure)
    }
}

impl From<Exit> for ExitCode {
    fn from(exit: Exit) -> ExitCode {
        ExitCode::from(exit.code())
    }
}

/// A command line that asks for something the config does not have.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

fn of_start(error: &StartError) -> Exit {
    match error {
        StartError::Database(database) => of_database(database),
        StartError::Source(source) => of_source(source),
        // A plugin or a statement that does not load, a listener that cannot bind, a
        // destination that cannot be built: each names its setting.
        StartError::Plugin(_)
        | StartError::Pipeline(_)
        | StartError::Http(_)
        | StartError::Destination(_) => Exit::Config,
    }
}

/// A database that could not be opened or checked: an outage, or a setting to change.
pub fn of_database(error: &DatabaseError) -> Exit {
    match error {
        DatabaseError::Connect { .. } | DatabaseError::Sessions { .. } => Exit::Unavailable,
        DatabaseError::Consumers { source, .. } => of_statement(source),
        DatabaseError::Migrate { .. } => Exit::Failure,
        DatabaseError::Refused { .. }
        | DatabaseError::ForeignClaims { .. }
        | DatabaseError::Elsewhere { .. }
        | DatabaseError::Schema { .. } => Exit::Config,
    }
}

/// A broker's refusal names a setting; anything else is an outage.
pub fn of_source(error: &SourceError) -> Exit {
    if error.is_refused() {
        Exit::Config
    } else {
        Exit::Unavailable
    }
}

/// A statement idem ran for the command: its failure is the configuration's or the
/// database's, as for a message's transaction (`store::fault`).
fn of_statement(error: &sqlx::Error) -> Exit {
    match fault::classify(error, Origin::Host) {
        Fault::Config => Exit::Config,
        Fault::Transient | Fault::Message => Exit::Unavailable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_has_its_number() {
        let all = [
            Exit::Success,
            Exit::Failure,
            Exit::Usage,
            Exit::Config,
            Exit::Unavailable,
            Exit::Findings,
        ];
        let codes: Vec<u8> = all.iter().map(|exit| exit.code()).collect();
        assert_eq!(codes, [0, 1, 2, 3, 4, 5]);
    }

    /// Problems a retry will not fix win over an outage, which wins over success.
    #[test]
    fn the_graver_outcome_wins() {
        assert_eq!(Exit::Success.worst(Exit::Unavailable), Exit::Unavailable);
        assert_eq!(Exit::Unavailable.worst(Exit::Findings), Exit::Findings);
        assert_eq!(Exit::Findings.worst(Exit::Unavailable), Exit::Findings);
        assert_eq!(Exit::Config.worst(Exit::Success), Exit::Config);
    }

    /// The cause decides, wherever it is in the chain.
    #[test]
    fn an_error_exits_by_its_cause() {
        let invalid = anyhow::Error::new(ConfigError::Invalid {
            path: "p.toml".into(),
            message: "bad".into(),
        })
        .context("loading");
        assert_eq!(Exit::of_error(&invalid), Exit::Config);
        let usage = anyhow::Error::new(UsageError("no pipeline \"x\"".into()));
        assert_eq!(Exit::of_error(&usage), Exit::Usage);
        let unreachable = anyhow::Error::new(DatabaseError::Connect {
            endpoint: "127.0.0.1:1".into(),
            source: sqlx::Error::PoolTimedOut,
        });
        assert_eq!(Exit::of_error(&unreachable), Exit::Unavailable);
        let other = anyhow::anyhow!("something else");
        assert_eq!(Exit::of_error(&other), Exit::Failure);
    }
}
