//! The librdkafka settings of a Kafka source's clients: the brokers, TLS and SASL as the
//! source's settings name them, the pass-through properties, then what idem decides itself
//! (commits, the group's assignment, the idempotent dead-letter producer).

use rdkafka::ClientConfig;

use crate::config::KafkaConfig;

/// The settings every client of `source` shares: brokers, security, and the pass-through
/// properties (a consumer's own only for consumers). `client` names the connection in the
/// brokers' logs.
fn shared(source: &KafkaConfig, client: &str, consumer: bool) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", source.brokers.join(","))
        .set("client.id", client);
    let protocol = match (source.tls.is_some(), source.sasl.is_some()) {
        (false, false) => "plaintext",
        (true, false) => "ssl",
        (false, true) => "sasl_plaintext",
        (true, true) => "sasl_ssl",
    };
    config.set("security.protocol", protocol);
    if let Some(tls) = &source.tls {
        // librdkafka speaks OpenSSL: the same PEM files the other kinds take.
        let path = |path: &std::path::Path| path.display().to_string();
        if let Some(ca) = &tls.ca_file {
            config.set("ssl.ca.location", path(ca));
        }
        if let Some(cert) = &tls.cert_file {
            config.set("ssl.certificate.location", path(cert));
        }
        if let Some(key) = &tls.key_file {
            config.set("ssl.key.location", path(key));
        }
    }
    if let Some(sasl) = &source.sasl {
        config
            .set("sasl.mechanism", sasl.mechanism.name())
            .set("sasl.username", &sasl.username)
            .set("sasl.password", &sasl.password);
    }
    for (name, value) in &source.properties {
        if consumer || !is_consumers(name) {
            config.set(name, value);
        }
    }
    config
}

/// The settings of a client that does not consume (the admin client, the producer).
pub fn common(source: &KafkaConfig, client: &str) -> ClientConfig {
    shared(source, client, false)
}

/// The librdkafka properties only a consumer reads (a producer given one warns in the log).
const CONSUMER_PROPERTIES: [&str; 12] = [
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "max.poll.interval.ms",
    "group.",
    "fetch.",
    "queued.",
    "auto.commit.interval.ms",
    "isolation.level",
    "check.crcs",
    "coordinator.query.interval.ms",
    "consume.callback.max.messages",
    "enable.partition.eof",
];

fn is_consumers(name: &str) -> bool {
    CONSUMER_PROPERTIES.iter().any(|property| {
        name == *property || (property.ends_with('.') && name.starts_with(property))
    })
}

/// The group consumer's settings: no automatic commit or offset store (idem commits the
/// settled floor), offsets set at assignment (a lost position falls back to the earliest).
pub fn consumer(source: &KafkaConfig, client: &str) -> ClientConfig {
    let mut config = shared(source, client, true);
    config
        .set("group.id", &source.group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set(
            "partition.assignment.strategy",
            source.assignment.strategy(),
        );
    config
}

/// A consumer that never joins the group (it assigns partitions itself, to read dead
/// letters, offsets and ends) and commits nothing: the group consumer's settings, and the
/// end of each partition said.
pub fn reader(source: &KafkaConfig, client: &str) -> ClientConfig {
    let mut config = consumer(source, client);
    config.set("enable.partition.eof", "true");
    config
}

/// The dead-letter producer: idempotent, every in-sync replica acknowledging.
pub fn producer(source: &KafkaConfig, client: &str) -> ClientConfig {
    let mut config = common(source, client);
    config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.timeout.ms", "30000");
    config
}
