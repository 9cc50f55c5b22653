//! One `idem run` host of the soak: started, killed, signalled, stopped.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{IdemProcess, idem_binary};

/// One `idem run` host and the config it runs with.
pub(super) struct HostSlot {
    pub(super) config: PathBuf,
    /// Its config once idem's tables moved into the schema named like the hosts' role.
    pub(super) moved_config: PathBuf,
    pub(super) http_port: u16,
    pub(super) process: Option<IdemProcess>,
    pub(super) log: PathBuf,
}

impl HostSlot {
    /// Host `name`'s slot in `directory`: `text` (whose `header` is the harness's) run as
    /// `role`, and the same once idem's tables moved into the schema named like `role`.
    pub(super) fn configured(
        directory: &Path,
        name: &str,
        text: &str,
        header: &str,
        role: &str,
        http_port: u16,
    ) -> HostSlot {
        let config = directory.join(format!("{name}.toml"));
        let moved_config = directory.join(format!("{name}-moved.toml"));
        let text = text.replacen(header, &as_role(header, role), 1);
        let moved = text.replacen(
            "[database]\n",
            &format!("[database]\nschema = \"{role}\"\n"),
            1,
        );
        std::fs::write(&config, text).expect("write config");
        std::fs::write(&moved_config, moved).expect("write config");
        HostSlot {
            config,
            moved_config,
            http_port,
            process: None,
            log: directory.join(format!("{name}.log")),
        }
    }

    pub(super) fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("host log");
        let mut command = Command::new(idem_binary());
        command
            .args(["run", "--config"])
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .env("RUST_LOG", "idem_host=info,warn");
        self.process = Some(IdemProcess::spawn(&mut command));
    }

    /// Puts its Kafka pipeline in consumer group `group` (both configs), from its next start.
    pub(super) fn join_kafka_group(&self, group: &str) {
        for path in [&self.config, &self.moved_config] {
            let text = std::fs::read_to_string(path).expect("a host's config");
            let text: String = text
                .lines()
                .filter(|line| !line.starts_with("group = "))
                .map(|line| {
                    if line == "kind = \"kafka\"" {
                        format!("{line}\ngroup = \"{group}\"\n")
                    } else {
                        format!("{line}\n")
                    }
                })
                .collect();
            std::fs::write(path, text).expect("write config");
        }
    }

    /// Whether its process runs (or is stopped by a signal), not exited.
    pub(super) fn is_running(&mut self) -> bool {
        self.process
            .as_mut()
            .is_some_and(|process| matches!(process.try_wait(), Ok(None)))
    }

    pub(super) fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(|process| process.id())
    }

    pub(super) fn kill(&mut self) {
        if let Some(mut process) = self.process.take() {
            let _ = process.kill();
            let _ = process.wait();
        }
    }

    pub(super) fn signal(&self, signal: &str) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill")
                .args([signal, &pid.to_string()])
                .status();
        }
    }

    /// SIGTERM and a clean exit; `false` if it did not exit 0.
    pub(super) fn stop(&mut self) -> bool {
        match self.process.take() {
            Some(process) => process.terminate().success(),
            None => true,
        }
    }
}

/// `header` (the `[database]` and `[amqp]` tables) with the database URL's user `role`.
fn as_role(header: &str, role: &str) -> String {
    header
        .lines()
        .map(|line| match line.strip_prefix("url = \"postgres://") {
            Some(rest) => {
                let host = rest.split_once('@').map_or(rest, |(_, host)| host);
                format!("url = \"postgres://{role}@{host}")
            }
            None => line.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}
