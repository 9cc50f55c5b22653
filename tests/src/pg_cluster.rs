//! A PostgreSQL cluster of a test's own: `initdb` into the test's directory, its own port and
//! socket directory, run as the `postgres` user (PostgreSQL refuses root), stopped when
//! dropped. For the topologies one server cannot play: several hosts, one of them read-only.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{free_port, listens_within, set_mode};

/// A running cluster.
pub struct PgCluster {
    pub port: u16,
    directory: PathBuf,
}

impl PgCluster {
    /// Creates and starts a cluster named after `label`, `settings` appended to its
    /// `postgresql.conf`. Panics with its log when it does not start.
    pub fn start(label: &str, settings: &str) -> PgCluster {
        let directory = std::env::temp_dir().join(format!("{label}-pg"));
        if directory.exists() {
            let _ = stop(&directory);
            let _ = std::fs::remove_dir_all(&directory);
        }
        std::fs::create_dir_all(&directory).expect("cluster directory");
        set_mode(&directory, 0o777);
        let port = free_port();
        let cluster = PgCluster { port, directory };
        let data = cluster.data();
        as_postgres(
            Command::new(bin("initdb"))
                .args(["--auth=trust", "--username=postgres", "--no-sync", "-D"])
                .arg(&data),
        );
        let conf = format!(
            "\nlisten_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{}'\n\
             fsync = off\nmax_connections = 60\n{settings}\n",
            cluster.directory.display()
        );
        let path = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&path).expect("postgresql.conf");
        text.push_str(&conf);
        std::fs::write(&path, text).expect("postgresql.conf");
        cluster.ctl(&["start", "-w", "-t", "30"]);
        assert!(
            listens_within(port, Duration::from_secs(30)),
            "cluster {label} did not listen: {}",
            cluster.log()
        );
        cluster
    }

    /// A URL of `database` on this cluster.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{database}?sslmode=disable",
            self.port
        )
    }

    /// Runs `sql` as postgres on database `postgres` (`psql`, one transaction per statement);
    /// panics on an error.
    pub fn psql(&self, sql: &str) {
        as_postgres(
            Command::new("psql")
                .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p"])
                .arg(self.port.to_string())
                .args(["-U", "postgres", "-d", "postgres", "-c", sql]),
        );
    }

    /// Makes the cluster take no writes (`default_transaction_read_only`, as a standby does), or
    /// take them again; new sessions see it at once, open ones at their next statement.
    pub fn set_read_only(&self, read_only: bool) {
        self.psql(if read_only {
            "ALTER SYSTEM SET default_transaction_read_only = on"
        } else {
            "ALTER SYSTEM RESET default_transaction_read_only"
        });
        self.psql("SELECT pg_reload_conf()");
    }

    /// Its server log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.directory.join("server.log")).unwrap_or_default()
    }

    fn data(&self) -> PathBuf {
        self.directory.join("data")
    }

    fn ctl(&self, args: &[&str]) {
        as_postgres(
            Command::new(bin("pg_ctl"))
                .arg("-D")
                .arg(self.data())
                .arg("-l")
                .arg(self.directory.join("server.log"))
                .args(args),
        );
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let _ = stop(&self.directory);
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}

/// Stops the cluster in `directory` at once (`pg_ctl stop -m immediate`).
fn stop(directory: &Path) -> std::io::Result<std::process::Output> {
    let mut command = Command::new(bin("pg_ctl"));
    command
        .arg("-D")
        .arg(directory.join("data"))
        .args(["stop", "-m", "immediate", "-w"]);
    postgres_user(&mut command).output()
}

/// `program` of the installed PostgreSQL (the newest in /usr/lib/postgresql).
pub(crate) fn bin(program: &str) -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL installed")
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .collect();
    versions.sort();
    versions
        .last()
        .expect("a PostgreSQL version")
        .join("bin")
        .join(program)
}

/// `command` as the postgres user when this is root (PostgreSQL refuses to run as root).
fn postgres_user(command: &mut Command) -> &mut Command {
    if crate::is_root() {
        let program = command.get_program().to_owned();
        let args: Vec<_> = command.get_args().map(|arg| arg.to_owned()).collect();
        let mut wrapped = Command::new("runuser");
        wrapped
            .args(["-u", "postgres", "--"])
            .arg(program)
            .args(args);
        *command = wrapped;
    }
    command
}

/// Runs `command` (as postgres), which must succeed.
fn as_postgres(command: &mut Command) {
    let output = postgres_user(command).output().expect("run");
    assert!(
        output.status.success(),
        "{:?}: {}{}",
        command,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
