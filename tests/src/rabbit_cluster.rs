//! RabbitMQ nodes of a test's own, clustered: each its own node name, AMQP and distribution
//! ports, data directory and cookie, started with the broker's scripts (not the system
//! service) and killed by pid. The nodes stop when the cluster is dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{free_port, set_mode};

/// Where Debian keeps the broker's scripts (the ones in /usr/sbin switch to the rabbitmq
/// user; these run as the caller).
const SCRIPTS: &str = "/usr/lib/rabbitmq/bin";

/// One node of the cluster.
pub struct Node {
    /// `<name>@localhost`.
    pub name: String,
    pub port: u16,
    process: Option<Child>,
}

/// A cluster of nodes joined to the first; every node is stopped on drop.
pub struct Cluster {
    pub nodes: Vec<Node>,
    directory: PathBuf,
}

impl Cluster {
    /// Starts `size` nodes named after `label` and joins them into one cluster. Panics with
    /// the node's log when one does not come up.
    pub fn start(label: &str, size: usize) -> Cluster {
        let directory = std::env::temp_dir().join(format!("{label}-rabbit"));
        let _ = std::fs::remove_dir_all(&directory);
        std::fs::create_dir_all(&directory).expect("cluster directory");
        let cookie = directory.join(".erlang.cookie");
        std::fs::write(&cookie, format!("IDEMTEST{}", label.len() * 7919)).expect("cookie");
        set_mode(&cookie, 0o400);
        let mut cluster = Cluster {
            nodes: Vec::new(),
            directory,
        };
        for index in 0..size {
            let name = format!("{}-{index}@localhost", label.replace('_', "-"));
            let port = free_port();
            let node = Node {
                process: Some(cluster.spawn(&name, port)),
                name,
                port,
            };
            cluster.nodes.push(node);
        }
        for node in &cluster.nodes {
            cluster.await_startup(&node.name);
        }
        let first = cluster.nodes[0].name.clone();
        for node in &cluster.nodes[1..] {
            cluster.ctl(&node.name, &["stop_app"]);
            cluster.ctl(&node.name, &["join_cluster", &first]);
            cluster.ctl(&node.name, &["start_app"]);
        }
        cluster
    }

    /// Waits (up to two minutes) until node `name` has registered and booted.
    fn await_startup(&self, name: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while std::time::Instant::now() < deadline {
            if self
                .try_ctl(name, &["await_startup", "--timeout", "30"])
                .is_some()
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        // Once more, to panic with what rabbitmqctl and the node said.
        self.ctl(name, &["await_startup", "--timeout", "5"]);
    }

    /// The AMQP URL of node `index`.
    pub fn url(&self, index: usize) -> String {
        format!(
            "amqp://guest:guest@127.0.0.1:{}/%2f",
            self.nodes[index].port
        )
    }

    fn node_directory(&self, name: &str) -> PathBuf {
        self.directory.join(name.split('@').next().unwrap_or(name))
    }

    fn spawn(&self, name: &str, port: u16) -> Child {
        let base = self.node_directory(name);
        std::fs::create_dir_all(base.join("log")).expect("node directory");
        std::fs::write(base.join("enabled_plugins"), "[].\n").expect("plugins file");
        std::fs::write(
            base.join("rabbitmq.conf"),
            format!(
                "listeners.tcp.default = {port}\nloopback_users = none\ncluster_partition_handling = pause_minority\n"
            ),
        )
        .expect("node config");
        std::fs::write(base.join("rabbitmq-env.conf"), "").expect("env file");
        let log = std::fs::File::create(base.join("stdout.log")).expect("stdout log");
        let mut command = Command::new(Path::new(SCRIPTS).join("rabbitmq-server"));
        self.environment(&mut command, name);
        command
            .env("RABBITMQ_NODE_PORT", port.to_string())
            .env("RABBITMQ_DIST_PORT", free_port().to_string())
            .env("RABBITMQ_BASE", &base)
            .env("RABBITMQ_MNESIA_BASE", base.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", base.join("log"))
            .env("RABBITMQ_PID_FILE", base.join("pid"))
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                base.join("enabled_plugins"),
            )
            .env("RABBITMQ_CONFIG_FILE", base.join("rabbitmq.conf"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start a RabbitMQ node")
    }

    /// What every command of this cluster's nodes shares: the node, its cookie (in HOME),
    /// no system env file.
    fn environment(&self, command: &mut Command, name: &str) {
        command
            .env("HOME", &self.directory)
            .env("RABBITMQ_NODENAME", name)
            .env(
                "RABBITMQ_CONF_ENV_FILE",
                self.node_directory(name).join("rabbitmq-env.conf"),
            )
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            // A VM that dies writes its crash dump here, not into the working directory.
            .env("ERL_CRASH_DUMP", self.directory.join("erl_crash.dump"));
    }

    /// Runs `rabbitmqctl -n <name> <args>`; panics with its output (and the node's log) when
    /// it fails.
    pub fn ctl(&self, name: &str, args: &[&str]) -> String {
        let mut command = Command::new(Path::new(SCRIPTS).join("rabbitmqctl"));
        self.environment(&mut command, name);
        let output = command
            .arg("-n")
            .arg(name)
            .args(args)
            .output()
            .expect("run rabbitmqctl");
        let stdout = String::from_utf8_lossy(&output.stdout).to_string();
        if !output.status.success() {
            let log = std::fs::read_to_string(self.node_directory(name).join("stdout.log"))
                .unwrap_or_default();
            panic!(
                "rabbitmqctl -n {name} {args:?}: {}{}\n--- node output ---\n{log}",
                stdout,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        stdout
    }

    /// Runs `rabbitmqctl -n <name> <args>`: its output, or `None` when it failed.
    fn try_ctl(&self, name: &str, args: &[&str]) -> Option<String> {
        let mut command = Command::new(Path::new(SCRIPTS).join("rabbitmqctl"));
        self.environment(&mut command, name);
        let output = command.arg("-n").arg(name).args(args).output().ok()?;
        output
            .status
            .success()
            .then(|| String::from_utf8_lossy(&output.stdout).to_string())
    }

    /// `queue`'s rows of `list_queues <item>` asked of node `asking`: the item's value.
    fn queue_item(&self, asking: usize, queue: &str, item: &str) -> Option<String> {
        let listed = self.try_ctl(
            &self.nodes[asking].name,
            &["list_queues", "name", item, "--quiet", "--no-table-headers"],
        )?;
        listed
            .lines()
            .filter_map(|line| line.split_once('\t'))
            .find(|(name, _)| name.trim() == queue)
            .map(|(_, value)| value.trim().to_string())
    }

    /// The node that leads quorum queue `queue` now, asked of node `asking`; `None` while
    /// the queue does not exist.
    pub fn try_leader(&self, asking: usize, queue: &str) -> Option<usize> {
        let leader = self.queue_item(asking, queue, "leader")?;
        self.nodes.iter().position(|node| node.name == leader)
    }

    /// The cluster's state and its queues, as node `asking` sees them, for a failure's
    /// message.
    pub fn describe(&self, asking: usize) -> String {
        let name = &self.nodes[asking].name;
        let status = self
            .try_ctl(name, &["cluster_status", "--quiet"])
            .unwrap_or_default();
        let queues = self
            .try_ctl(
                name,
                &[
                    "list_queues",
                    "name",
                    "type",
                    "leader",
                    "members",
                    "online",
                    "messages",
                    "consumers",
                    "--quiet",
                ],
            )
            .unwrap_or_default();
        format!("{status}\n{queues}")
    }

    /// Messages in `queue` (ready and unacked), asked of node `asking`.
    pub fn messages(&self, asking: usize, queue: &str) -> u64 {
        self.queue_item(asking, queue, "messages")
            .and_then(|count| count.parse().ok())
            .unwrap_or_else(|| panic!("no count for {queue:?}"))
    }

    /// SIGKILLs node `index` (the Erlang VM, by the pid it wrote), as a crash would.
    pub fn kill(&mut self, index: usize) {
        let name = self.nodes[index].name.clone();
        if let Ok(pid) = std::fs::read_to_string(self.node_directory(&name).join("pid")) {
            let _ = Command::new("kill")
                .args(["-KILL", pid.trim()])
                .stderr(Stdio::null())
                .status();
        }
        if let Some(mut process) = self.nodes[index].process.take() {
            let _ = process.kill();
            let _ = process.wait();
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for index in 0..self.nodes.len() {
            self.kill(index);
        }
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}
