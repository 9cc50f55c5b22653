//! A PgBouncer of a test's own, in front of the machine's PostgreSQL: Debian's pgbouncer with
//! the settings it ships (no `ignore_startup_parameters`), its own port, directory and pool
//! mode, killed by pid when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{free_port, is_root, listens_within, set_mode};

/// Where Debian installs it (`scripts/test.sh` installs the package when missing).
const BINARY: &str = "/usr/sbin/pgbouncer";

/// A running pgbouncer.
pub struct PgBouncer {
    pub port: u16,
    directory: PathBuf,
    process: Child,
}

impl PgBouncer {
    /// Starts pgbouncer in `pool_mode` (`session` or `transaction`) with `server_connections`
    /// server connections per database and user, every database of 127.0.0.1:5432 behind it.
    /// Panics with its log when it does not listen within 10 s.
    pub fn start(label: &str, pool_mode: &str, server_connections: u32) -> PgBouncer {
        PgBouncer::in_front_of(5432, label, pool_mode, server_connections)
    }

    /// As [`PgBouncer::start`], in front of the PostgreSQL on 127.0.0.1:`server_port`.
    pub fn in_front_of(
        server_port: u16,
        label: &str,
        pool_mode: &str,
        server_connections: u32,
    ) -> PgBouncer {
        let directory = std::env::temp_dir().join(format!("{label}-pgbouncer"));
        let _ = std::fs::remove_dir_all(&directory);
        std::fs::create_dir_all(&directory).expect("pgbouncer directory");
        // pgbouncer refuses to run as root: it runs as postgres (`-u`), which must write here.
        set_mode(&directory, 0o777);
        let port = free_port();
        let users = directory.join("userlist.txt");
        std::fs::write(&users, "\"postgres\" \"\"\n").expect("userlist");
        let ini = directory.join("pgbouncer.ini");
        std::fs::write(
            &ini,
            format!(
                "[databases]\n* = host=127.0.0.1 port={server_port}\n\n[pgbouncer]\n\
                 listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {}\npool_mode = {pool_mode}\n\
                 default_pool_size = {server_connections}\nmax_client_conn = 500\n\
                 logfile = {}\npidfile = {}\n",
                users.display(),
                directory.join("pgbouncer.log").display(),
                directory.join("pgbouncer.pid").display(),
            ),
        )
        .expect("pgbouncer.ini");
        let mut command = Command::new(BINARY);
        if is_root() {
            command.args(["-u", "postgres"]);
        }
        let process = command
            .arg(&ini)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("{BINARY}: {error} (install the pgbouncer package)"));
        let bouncer = PgBouncer {
            port,
            directory,
            process,
        };
        assert!(
            listens_within(port, Duration::from_secs(10)),
            "pgbouncer did not listen on {port}: {}",
            bouncer.log()
        );
        bouncer
    }

    /// A URL of `database` through this pgbouncer.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{database}?sslmode=disable",
            self.port
        )
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.directory.join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}
