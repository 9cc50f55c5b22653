//! One `idem run` host of the soak: started, killed, signalled, stopped.

use std::path::PathBuf;
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
