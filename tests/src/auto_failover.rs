//! A pg_auto_failover formation of a test's own (Debian's `postgresql-15-auto-failover`): a
//! monitor and two PostgreSQL nodes on this machine, each its own port and data directory,
//! kept by `pg_autoctl run` processes that run as the `postgres` user. Stopped on drop.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::{free_port, is_root, set_mode};

/// One `pg_autoctl run` and the PostgreSQL it keeps.
struct Keeper {
    pgdata: PathBuf,
    port: u16,
    process: Mutex<Option<Child>>,
}

impl Keeper {
    /// SIGKILLs the keeper's process group, then its PostgreSQL if that still runs.
    fn kill(&self) {
        if let Some(mut process) = self.process.lock().expect("keeper").take() {
            let group = format!("-{}", process.id());
            let _ = Command::new("kill").args(["-9", "--", &group]).status();
            let _ = process.wait();
        }
        if let Some(pid) = postmaster_pid(&self.pgdata) {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
    }
}

/// The monitor and the nodes.
pub struct Formation {
    directory: PathBuf,
    monitor: Keeper,
    nodes: Vec<Keeper>,
}

impl Formation {
    /// Creates the monitor and `nodes` PostgreSQL nodes, and waits until one is primary and
    /// the others secondary (up to 3 minutes). Panics with the keepers' logs otherwise.
    pub fn start(label: &str, nodes: usize) -> Formation {
        let directory = std::env::temp_dir().join(format!("{label}-paf"));
        if directory.exists() {
            stop_all(&directory);
            let _ = std::fs::remove_dir_all(&directory);
        }
        std::fs::create_dir_all(&directory).expect("formation directory");
        set_mode(&directory, 0o777);
        let mut formation = Formation {
            monitor: Keeper {
                pgdata: directory.join("monitor"),
                port: free_port(),
                process: Mutex::new(None),
            },
            nodes: Vec::new(),
            directory,
        };
        let monitor_port = formation.monitor.port.to_string();
        formation.autoctl_ok(&[
            "create",
            "monitor",
            "--pgdata",
            &formation.monitor.pgdata.display().to_string(),
            "--pgport",
            &monitor_port,
            "--hostname",
            "127.0.0.1",
            "--auth",
            "trust",
            "--no-ssl",
        ]);
        let monitor = formation.spawn_run(&formation.monitor.pgdata, "monitor");
        *formation.monitor.process.lock().expect("keeper") = Some(monitor);
        let monitor_uri = formation.monitor_uri();
        formation.wait_for_monitor(&monitor_uri);
        for index in 0..nodes {
            let keeper = Keeper {
                pgdata: formation.directory.join(format!("node{index}")),
                port: free_port(),
                process: Mutex::new(None),
            };
            formation.autoctl_ok(&[
                "create",
                "postgres",
                "--pgdata",
                &keeper.pgdata.display().to_string(),
                "--pgport",
                &keeper.port.to_string(),
                "--hostname",
                "127.0.0.1",
                "--name",
                &format!("node{index}"),
                "--auth",
                "trust",
                "--no-ssl",
                "--monitor",
                &monitor_uri,
            ]);
            let process = formation.spawn_run(&keeper.pgdata, &format!("node{index}"));
            *keeper.process.lock().expect("keeper") = Some(process);
            formation.nodes.push(keeper);
        }
        formation.wait_until(
            "one primary, the others secondary",
            Duration::from_secs(180),
            |states| {
                states.iter().filter(|state| *state == "primary").count() == 1
                    && states.iter().filter(|state| *state == "secondary").count() == nodes - 1
            },
        );
        formation
    }

    /// The formation's multi-host URL of `database` (`pg_autoctl show uri`), as an application
    /// gets it: every node, `target_session_attrs=read-write`.
    pub fn url(&self, database: &str) -> String {
        let uri = self.autoctl_ok(&[
            "show",
            "uri",
            "--pgdata",
            &self.monitor.pgdata.display().to_string(),
            "--formation",
            "default",
        ]);
        let uri = uri.trim();
        // The nodes trust the postgres user; the URI names none (libpq would take the OS user).
        let uri = match uri.split_once("://") {
            Some((scheme, rest)) if !rest.split('/').next().unwrap_or_default().contains('@') => {
                format!("{scheme}://postgres@{rest}")
            }
            _ => uri.to_string(),
        };
        let (base, query) = uri.split_once('?').unwrap_or((&uri, ""));
        let prefix = base.rsplit_once('/').map_or(base, |(prefix, _)| prefix);
        format!("{prefix}/{database}?{query}")
    }

    /// A URL of `database` on node `index` alone.
    pub fn node_url(&self, index: usize, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{database}?sslmode=disable",
            self.nodes[index].port
        )
    }

    /// The port node `index` listens on.
    pub fn node_port(&self, index: usize) -> u16 {
        self.nodes[index].port
    }

    /// Which node takes writes now (asked directly: a dead primary's last report to the
    /// monitor still says `primary`).
    pub fn writable(&self) -> Option<usize> {
        (0..self.nodes.len()).find(|&index| {
            if self.nodes[index].process.lock().expect("keeper").is_none() {
                return false;
            }
            Command::new("psql")
                .arg(format!(
                    "{}&connect_timeout=2",
                    self.node_url(index, "postgres")
                ))
                .args(["-X", "-A", "-t", "-c", "SHOW transaction_read_only"])
                .output()
                .is_ok_and(|output| output.stdout.starts_with(b"off"))
        })
    }

    /// `pg_autoctl perform failover`: the primary hands over to the secondary; returns when
    /// the monitor reports it done.
    pub fn perform_failover(&self) {
        self.autoctl_ok(&[
            "perform",
            "failover",
            "--pgdata",
            &self.monitor.pgdata.display().to_string(),
        ]);
    }

    /// SIGKILLs node `index`: its keeper, the keeper's services and its PostgreSQL, as when
    /// its machine dies; it stays down until the formation is dropped.
    pub fn kill_node(&self, index: usize) {
        self.nodes[index].kill();
    }

    /// Waits until the states of the nodes (in order) satisfy `done`.
    pub fn wait_until(&self, what: &str, timeout: Duration, done: impl Fn(&[String]) -> bool) {
        let started = Instant::now();
        loop {
            let states = self.states();
            if done(&states) {
                return;
            }
            assert!(
                started.elapsed() < timeout,
                "pg_auto_failover: {what} not reached within {timeout:?} (states {states:?}):\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Each node's state as it last reported it to the monitor, in node order (`unknown`
    /// when the monitor does not answer or does not list it).
    pub fn states(&self) -> Vec<String> {
        let output = Command::new("psql")
            .args([&self.monitor_uri(), "-X", "-A", "-t", "-F", " ", "-c"])
            .arg("SELECT nodeport, reportedstate FROM pgautofailover.node")
            .output()
            .map(|output| String::from_utf8_lossy(&output.stdout).into_owned())
            .unwrap_or_default();
        self.nodes
            .iter()
            .map(|node| {
                output
                    .lines()
                    .filter_map(|line| line.split_once(' '))
                    .find(|(port, _)| *port == node.port.to_string())
                    .map_or("unknown", |(_, state)| state.trim())
                    .to_string()
            })
            .collect()
    }

    fn monitor_uri(&self) -> String {
        format!(
            "postgres://autoctl_node@127.0.0.1:{}/pg_auto_failover?sslmode=disable",
            self.monitor.port
        )
    }

    fn wait_for_monitor(&self, monitor_uri: &str) {
        let started = Instant::now();
        while !Command::new("psql")
            .args([monitor_uri, "-X", "-q", "-c", "SELECT 1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
        {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the monitor did not answer:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Starts `pg_autoctl run` for `pgdata`, its output in `<name>.log`.
    fn spawn_run(&self, pgdata: &Path, name: &str) -> Child {
        let log = std::fs::File::create(self.directory.join(format!("{name}.log"))).expect("log");
        set_mode(&self.directory.join(format!("{name}.log")), 0o666);
        self.command(&["run", "--pgdata", &pgdata.display().to_string()])
            // Its own process group: the keeper's services and PostgreSQL die with it.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("pg_autoctl run")
    }

    fn logs(&self) -> String {
        let mut logs = String::new();
        for name in std::iter::once("monitor".to_string())
            .chain((0..self.nodes.len()).map(|index| format!("node{index}")))
        {
            let text = std::fs::read_to_string(self.directory.join(format!("{name}.log")))
                .unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            logs.push_str(&format!("--- {name}\n"));
            for line in tail.into_iter().rev() {
                logs.push_str(line);
                logs.push('\n');
            }
        }
        logs
    }

    /// `pg_autoctl <args>` as postgres, with this formation's own configuration directories.
    fn command(&self, args: &[&str]) -> Command {
        let mut command = if is_root() {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--", "env"]);
            command
        } else {
            Command::new("env")
        };
        command
            .arg(format!(
                "XDG_CONFIG_HOME={}",
                self.directory.join("config").display()
            ))
            .arg(format!(
                "XDG_DATA_HOME={}",
                self.directory.join("data").display()
            ))
            .arg(format!(
                "PG_CONFIG={}",
                crate::pg_cluster::bin("pg_config").display()
            ))
            .arg("pg_autoctl")
            .args(args);
        command
    }

    fn autoctl_ok(&self, args: &[&str]) -> String {
        let output = self.command(args).output().expect("pg_autoctl");
        assert!(
            output.status.success(),
            "pg_autoctl {args:?}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }
}

impl Drop for Formation {
    fn drop(&mut self) {
        for keeper in self.nodes.iter().chain(std::iter::once(&self.monitor)) {
            keeper.kill();
        }
        stop_all(&self.directory);
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}

/// SIGKILLs every PostgreSQL under `directory` (its `postmaster.pid`s).
fn stop_all(directory: &Path) {
    let Ok(entries) = std::fs::read_dir(directory) else {
        return;
    };
    for entry in entries.flatten() {
        if let Some(pid) = postmaster_pid(&entry.path()) {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
    }
}

fn postmaster_pid(pgdata: &Path) -> Option<u32> {
    std::fs::read_to_string(pgdata.join("postmaster.pid"))
        .ok()?
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}
