//! A test's own JetStream stream on the machine's nats-server (`scripts/services.sh` starts it
//! with JetStream): created as infrastructure code would, published to, inspected, deleted.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::pull, stream};
use bytes::Bytes;

/// The NATS server the tests use.
pub fn nats_url() -> String {
    std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// One test's stream, named after its env's queue; `cleanup` deletes it and its dead letters.
pub struct TestStream {
    /// The NATS server it lives on.
    pub url: String,
    pub name: String,
    /// The subject orders are published to (the stream captures `<name>.>`).
    pub subject: String,
    pub dead_letter_subject: String,
    pub dead_letter_stream: String,
    pub context: jetstream::Context,
}

impl TestStream {
    /// Creates the stream (subjects `<name>.>`) for a test whose queue is `queue`, on the
    /// machine's nats-server.
    pub async fn new(queue: &str) -> TestStream {
        TestStream::on(&nats_url(), queue).await
    }

    /// [`TestStream::new`] on the nats-server at `url`.
    pub async fn on(url: &str, queue: &str) -> TestStream {
        let client = async_nats::connect(url)
            .await
            .expect("nats-server with JetStream reachable (scripts/services.sh starts it)");
        TestStream::through(client, url, queue).await
    }

    /// [`TestStream::new`] through `client`, connected to the nats-server at `url` (the
    /// pipelines' `servers`).
    pub async fn through(client: async_nats::Client, url: &str, queue: &str) -> TestStream {
        let name = queue.replace('.', "_");
        let context = jetstream::new(client);
        context
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![format!("{name}.>")],
                ..stream::Config::default()
            })
            .await
            .expect("create the test stream");
        TestStream {
            url: url.to_string(),
            subject: format!("{name}.orders"),
            dead_letter_subject: format!("{name}-dead-letter.rejected"),
            dead_letter_stream: format!("{name}_DEAD_LETTERS"),
            name,
            context,
        }
    }

    /// A `[pipelines.<pipeline>]` table consuming this stream with `plugin`; `extra` goes into
    /// the pipeline's table (keys, then sub-tables), `source_extra` into its source.
    pub fn pipeline_table(
        &self,
        pipeline: &str,
        plugin: &Path,
        source_extra: &str,
        extra: &str,
    ) -> String {
        format!(
            r#"
[pipelines.{pipeline}]
consumer = "{pipeline}"
plugin = "{plugin}"
prefetch = 64
workers = 8
source = {{ kind = "jetstream", servers = ["{url}"], stream = "{stream}", subject = "{subject}", dead_letter_subject = "{dead_letter_subject}", dead_letter_stream = "{dead_letter_stream}"{source_extra} }}
{extra}

[pipelines.{pipeline}.statements]
{statements}"#,
            statements = crate::LOYALTY_STATEMENTS,
            plugin = plugin.display(),
            url = self.url,
            stream = self.name,
            subject = self.subject,
            dead_letter_subject = self.dead_letter_subject,
            dead_letter_stream = self.dead_letter_stream,
        )
    }

    /// Publishes `body` to the orders subject and waits for the stream to store it. `id` sets
    /// `Nats-Msg-Id` (the stream drops a repeat of an id it has seen).
    pub async fn publish(&self, body: &[u8], id: Option<&str>) {
        let mut headers = HeaderMap::new();
        if let Some(id) = id {
            headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
        }
        self.context
            .publish_with_headers(self.subject.clone(), headers, Bytes::copy_from_slice(body))
            .await
            .expect("publish")
            .await
            .expect("stored by the stream");
    }

    /// Publishes `body` once; whether the stream confirmed it stored it (a publish without
    /// confirmation may still have been stored).
    pub async fn try_publish(&self, body: &[u8]) -> bool {
        // Bounded: while the client reconnects to a restarted server, a publish may wait for
        // room in its buffer; the caller tries again rather than wait on one.
        let publish = async {
            match self
                .context
                .publish(self.subject.clone(), Bytes::copy_from_slice(body))
                .await
            {
                Ok(stored) => stored.await.is_ok(),
                Err(_) => false,
            }
        };
        tokio::time::timeout(Duration::from_secs(5), publish)
            .await
            .unwrap_or(false)
    }

    /// The durable consumer `consumer`'s pending (not delivered) and unacknowledged counts.
    pub async fn consumer_counts(&self, consumer: &str) -> Option<(u64, usize)> {
        let stream = self.context.get_stream(&self.name).await.ok()?;
        let consumer = stream.get_consumer::<pull::Config>(consumer).await.ok()?;
        let info = consumer.get_info().await.ok()?;
        Some((info.num_pending, info.num_ack_pending))
    }

    /// The messages stored on the dead-letter stream: subject-less bodies with their headers.
    pub async fn dead_letters(&self) -> Vec<(Vec<u8>, Vec<(String, String)>)> {
        let Ok(stream) = self.context.get_stream(&self.dead_letter_stream).await else {
            return Vec::new();
        };
        let consumer = stream
            .create_consumer(pull::Config::default())
            .await
            .expect("an ephemeral consumer on the dead letters");
        let mut batch = consumer
            .fetch()
            .max_messages(10_000)
            .expires(Duration::from_secs(1))
            .messages()
            .await
            .expect("fetch dead letters");
        let mut letters = Vec::new();
        while let Some(Ok(message)) = futures::StreamExt::next(&mut batch).await {
            let headers = message
                .headers
                .as_ref()
                .map(idem_host::source::jetstream::header_pairs)
                .unwrap_or_default();
            letters.push((message.payload.to_vec(), headers));
        }
        letters
    }

    /// Deletes the durable consumer `consumer` (as an operator might, under load).
    /// The durable consumer `durable` (on the orders subject, explicit acks, `ack_wait`,
    /// `max_deliver`) and the dead-letter stream, as an operator makes them for a pipeline
    /// with `declare = false`.
    pub async fn operator_consumer(&self, durable: &str, max_deliver: i64, ack_wait: Duration) {
        self.context
            .create_stream(stream::Config {
                name: self.dead_letter_stream.clone(),
                subjects: vec![self.dead_letter_subject.clone()],
                ..stream::Config::default()
            })
            .await
            .expect("the dead-letter stream");
        self.context
            .create_consumer_on_stream(
                pull::Config {
                    durable_name: Some(durable.into()),
                    filter_subject: self.subject.clone(),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait,
                    max_deliver,
                    ..pull::Config::default()
                },
                &self.name,
            )
            .await
            .expect("the operator's consumer");
    }

    pub async fn delete_consumer(&self, consumer: &str) {
        self.context
            .delete_consumer_from_stream(consumer, &self.name)
            .await
            .expect("delete the consumer");
    }

    /// Deletes the stream and its dead-letter stream.
    pub async fn cleanup(self) {
        let _ = self.context.delete_stream(&self.name).await;
        let _ = self.context.delete_stream(&self.dead_letter_stream).await;
    }
}

/// A nats-server of a test's own (JetStream on, its own port and store), killed when dropped.
pub struct NatsServer {
    child: Option<Child>,
    pub port: u16,
    store: PathBuf,
    /// A configuration file it reads (`-c`), e.g. with a `tls` block.
    config: Option<PathBuf>,
}

impl NatsServer {
    pub fn start(port: u16, store: PathBuf) -> NatsServer {
        NatsServer::start_with(port, store, None)
    }

    /// Starts it with the configuration file `config` besides the command line's settings.
    pub fn start_with(port: u16, store: PathBuf, config: Option<PathBuf>) -> NatsServer {
        let mut server = NatsServer {
            child: None,
            port,
            store,
            config,
        };
        server.restart();
        server
    }

    /// Starts it (again) on the same port and store; waits until it accepts connections.
    pub fn restart(&mut self) {
        let binary = ["/usr/sbin/nats-server", "/usr/bin/nats-server"]
            .into_iter()
            .find(|path| std::path::Path::new(path).exists())
            .expect("nats-server installed (apt install nats-server)");
        let child = Command::new(binary)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.store)
            .args(
                self.config
                    .iter()
                    .flat_map(|config| [std::ffi::OsStr::new("-c"), config.as_os_str()]),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        assert!(
            crate::listens_within(self.port, Duration::from_secs(5)),
            "nats-server did not listen on {}",
            self.port
        );
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}
