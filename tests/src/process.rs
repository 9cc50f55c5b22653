//! The real `idem` binary and the machine's processes: running a command and reading what it
//! said, a host process killed when dropped, PostgreSQL restarted, ports and file modes.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `idem` binary of this build, for tests that kill or crash the process.
pub fn idem_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // A test runs from target/<profile>/deps/, a binary of this crate from target/<profile>/.
    let binary = exe
        .ancestors()
        .skip(1)
        .take(2)
        .map(|directory| directory.join("idem"))
        .find(|binary| binary.is_file())
        .unwrap_or_else(|| exe.with_file_name("idem"));
    assert!(
        binary.is_file(),
        "{} missing: build it with `cargo build -p idem-host` (cargo test --workspace does)",
        binary.display()
    );
    binary
}

/// An `idem` child process, killed when dropped so a failing test leaves no host behind.
pub struct IdemProcess(Child);

impl IdemProcess {
    /// Starts `command` (an `idem` binary, this build's or an installed one).
    pub fn spawn(command: &mut Command) -> IdemProcess {
        IdemProcess(command.spawn().expect("spawn idem"))
    }

    /// Sends SIGTERM and waits (60 s at most) for the process to exit; returns how it did.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let sent = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(sent.success(), "kill -TERM {}", self.0.id());
        let started = Instant::now();
        loop {
            if let Some(status) = self.0.try_wait().expect("wait idem") {
                return status;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "idem ignored SIGTERM for 60 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl std::ops::Deref for IdemProcess {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for IdemProcess {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for IdemProcess {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// What a finished process printed: its stdout, then its stderr.
pub fn said(output: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Runs `command`, which must succeed; returns what it printed.
pub fn must_run(command: &mut Command) -> String {
    let output = command
        .output()
        .unwrap_or_else(|error| panic!("run {command:?}: {error}"));
    let text = said(&output);
    assert!(output.status.success(), "{command:?}: {text}");
    text
}

/// Runs `idem <args> --config <config>`: its exit status, stdout and stderr.
pub fn idem_output(args: &[&str], config: &Path) -> (i32, String, String) {
    let output = Command::new(idem_binary())
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .expect("run idem");
    (
        output.status.code().expect("an exit status"),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Runs `idem <command> --config <path>`, which must succeed; returns its output.
pub fn must_succeed(command: &str, path: &Path) -> String {
    must_run(
        Command::new(idem_binary())
            .args([command, "--config"])
            .arg(path),
    )
}

/// Runs `idem <command> --config <file>`, which must exit non-zero within 10 s; returns its
/// output.
pub fn must_refuse(command: &str, config: &Path) -> String {
    must_refuse_with(command, config, &[])
}

/// [`must_refuse`] with extra environment variables.
pub fn must_refuse_with(command: &str, config: &Path, env: &[(&str, &str)]) -> String {
    refusal(command, config, env).1
}

/// Runs `idem <command> --config <file>`, which must exit non-zero within 10 s; returns its
/// exit status and output.
fn refusal(command: &str, config: &Path, env: &[(&str, &str)]) -> (i32, String) {
    let started = Instant::now();
    let mut child = Command::new(idem_binary())
        .args([command, "--config"])
        .arg(config)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idem");
    loop {
        if child.try_wait().expect("wait idem").is_some() {
            break;
        }
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let output = child.wait_with_output().expect("output");
            panic!(
                "idem {command} still running after 10 s (a retry loop?): {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output().expect("output");
    assert!(!output.status.success(), "idem {command} exited 0");
    (output.status.code().unwrap_or(-1), said(&output))
}

/// `idem run` and `idem check` with `config` both exit non-zero within 10 s, their output
/// naming `setting`: a fault no retry fixes (`case` says which, in the messages). `idem run`
/// exits 3 (the configuration is wrong), `idem check` 5 (it found a problem).
pub fn run_and_check_refuse(config: &Path, setting: &str, case: &str) {
    for (command, status) in [("run", 3), ("check", 5)] {
        let (code, output) = refusal(command, config, &[]);
        assert!(output.contains(setting), "{case}: idem {command}: {output}");
        assert_eq!(code, status, "{case}: idem {command} exit status: {output}");
        eprintln!("{case}: idem {command}: {}", output.trim());
    }
}

/// Starts `idem run` as a child process with extra environment variables.
pub fn spawn_idem(config: &Path, env: &[(&str, &str)]) -> IdemProcess {
    let mut command = Command::new(idem_binary());
    command
        .args(["run", "--config"])
        .arg(config)
        .stdin(Stdio::null())
        .env("RUST_LOG", "idem_host=debug,warn");
    for (name, value) in env {
        command.env(name, value);
    }
    IdemProcess::spawn(&mut command)
}

/// Restarts the machine's PostgreSQL cluster (`pg_ctlcluster … restart -m <mode>`: `fast`
/// or `immediate`); whether it came back. For fault tests, which run one at a time.
pub fn restart_postgres(mode: &str) -> bool {
    let Some(version) = std::fs::read_dir("/etc/postgresql")
        .ok()
        .and_then(|entries| entries.flatten().next())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
    else {
        return false;
    };
    Command::new("pg_ctlcluster")
        .args([
            "--skip-systemctl-redirect",
            &version,
            "main",
            "restart",
            "-m",
            mode,
        ])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// A free loopback port for a host's HTTP endpoint.
/// Whether a server of the test's own listens on 127.0.0.1:`port` within `timeout`.
pub(crate) fn listens_within(port: u16, timeout: Duration) -> bool {
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if started.elapsed() >= timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

/// Sets `path`'s Unix permission bits.
pub(crate) fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// Whether the tests run as root (servers that refuse root then run as another user).
pub(crate) fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|output| output.stdout.starts_with(b"0\n"))
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

/// Peak resident memory of process `pid`, in MiB.
pub fn peak_rss_mib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with("VmHWM:"))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib / 1024)
}
