//! `pipelines.toml` read whole: each table's checks, errors naming the line and the key, the schema.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::*;

const VALID: &str = r#"
[database]
url = "postgres://127.0.0.1/db"

[amqp]
url = "amqp://127.0.0.1"

[pipelines.loyalty]
queue = "order-completed"
plugin = "plugins/loyalty.wasm"

[pipelines.loyalty.statements]
credit = "UPDATE balances SET points = points + $2 WHERE customer_id = $1"
"#;

fn rabbitmq(pipeline: &PipelineConfig) -> &RabbitMqConfig {
    let SourceConfig::RabbitMq(source) = &pipeline.source else {
        panic!("a RabbitMQ source, not {:?}", pipeline.source);
    };
    source
}

/// A JetStream source: its defaults, and the keys of one kind refused on the other.
#[test]
fn a_jetstream_source() {
    let jetstream = |keys: &str| {
        VALID.replace("queue = \"order-completed\"\n", "")
            + "\n[pipelines.loyalty.source]\nkind = \"jetstream\"\n"
            + keys
    };
    let config = Config::from_toml(
        Path::new("/etc/idem/pipelines.toml"),
        &jetstream("servers = [\"nats://127.0.0.1:4222\"]\nstream = \"ORDERS\"\nsubject = \"orders.completed\"\n"),
    )
    .expect("a JetStream source");
    let pipeline = &config.pipelines[0];
    let SourceConfig::JetStream(source) = &pipeline.source else {
        panic!("not JetStream: {:?}", pipeline.source);
    };
    assert_eq!(source.consumer, "idem-loyalty");
    assert_eq!(source.ack_wait, Duration::from_secs(30));
    assert_eq!(source.max_deliver, None);
    assert_eq!(source.dead_letter_subject, "ORDERS_DEAD_LETTERS.loyalty");
    assert_eq!(source.dead_letter_stream, "ORDERS_DEAD_LETTERS");
    assert!(source.declare && source.in_progress);
    assert_eq!(pipeline.queue(), "ORDERS");
    assert_eq!(pipeline.source_kind(), "jetstream");

    let without_amqp = jetstream("servers = [\"nats://127.0.0.1:4222\"]\nstream = \"ORDERS\"\n")
        .replace("[amqp]\nurl = \"amqp://127.0.0.1\"\n", "");
    Config::from_toml(Path::new("/etc/idem/pipelines.toml"), &without_amqp)
        .expect("a stream-only config needs no [amqp]");
    check_error(
        &VALID.replace("[amqp]\nurl = \"amqp://127.0.0.1\"\n", ""),
        &[
            "amqp: missing",
            "[pipelines.loyalty] consumes a RabbitMQ queue",
        ],
    );
    check_error(
        &(without_amqp.clone()
            + "\n[outbox.destinations.audit]\nkind = \"amqp\"\nexchange = \"audit\"\n"),
        &[
            "amqp: missing",
            "outbox destination \"audit\" is a RabbitMQ exchange",
        ],
    );
    check_error(
        &jetstream(
            "servers = [\"nats://h\"]\nstream = \"ORDERS\"\nsubject = \"orders.>\"\ndead_letter_subject = \"orders.dead\"\n",
        ),
        &[
            "pipelines.loyalty.source.dead_letter_subject",
            "consumed by the pipeline itself",
        ],
    );
    assert!(subject_matches("orders.*.eu", "orders.created.eu"));
    assert!(!subject_matches("orders.*", "orders.created.eu"));
    assert!(!subject_matches("orders.>", "orders"));
    assert!(subject_matches("orders", "orders"));
    check_error(
        &jetstream("servers = [\"nats://127.0.0.1:4222\"]\n"),
        &["pipelines.loyalty.source.stream", "missing"],
    );
    check_error(
        &jetstream("stream = \"ORDERS\"\n"),
        &["pipelines.loyalty.source.servers", "missing"],
    );
    check_error(
        &jetstream("servers = [\"nats://h\"]\nstream = \"ORDERS\"\nqueue = \"q\"\n"),
        &["pipelines.loyalty.source.queue", "RabbitMQ setting"],
    );
    check_error(
        &jetstream("servers = [\"nats://h\"]\nstream = \"OR.DERS\"\n"),
        &["pipelines.loyalty.source.stream", "OR.DERS"],
    );
    check_error(
        &jetstream("servers = [\"nats://h\"]\nstream = \"ORDERS\"\nack_wait = \"10ms\"\n"),
        &["pipelines.loyalty.source.ack_wait", "at least 1s"],
    );
    // The default max_attempts is 5: a server limit of 5 deliveries leaves no room.
    check_error(
        &jetstream("servers = [\"nats://h\"]\nstream = \"ORDERS\"\nmax_deliver = 5\n"),
        &[
            "pipelines.loyalty.source.max_deliver",
            "leaves no room for max_attempts = 5",
        ],
    );
    let config = Config::from_toml(
        Path::new("/etc/idem/pipelines.toml"),
        &jetstream(
            "servers = [\"nats://h\"]\nstream = \"ORDERS\"\nmax_deliver = 6\nstart = \"all\"\n",
        ),
    )
    .unwrap_or_else(|error| panic!("{error}"));
    let SourceConfig::JetStream(source) = &config.pipelines[0].source else {
        panic!("a JetStream source");
    };
    assert_eq!(source.start, ConsumerStart::All);
    check_error(
        &jetstream("servers = [\"nats://h\"]\nstream = \"ORDERS\"\nstart = \"first\"\n"),
        &["start", "first"],
    );
    check_error(
        &(VALID.replace("queue = \"order-completed\"\n", "")
            + "\n[pipelines.loyalty.source]\nkind = \"rabbitmq\"\nqueue = \"q\"\nstream = \"S\"\n"),
        &["pipelines.loyalty.source.stream", "JetStream setting"],
    );
}

/// `[pipelines.<name>.source]` and the older form beside it describe the same source;
/// both at once, or neither, are refused with the form to use.
#[test]
fn a_source_table_or_the_older_queue_keys() {
    let source_form = VALID.replace("queue = \"order-completed\"\n", "")
        + "\n[pipelines.loyalty.source]\nkind = \"rabbitmq\"\nqueue = \"order-completed\"\nqueue_type = \"quorum\"\ndeclare = false\n";
    let config = Config::from_toml(Path::new("/etc/idem/pipelines.toml"), &source_form)
        .expect("the source form");
    let source = rabbitmq(&config.pipelines[0]);
    assert_eq!(source.queue, "order-completed");
    assert_eq!(source.dead_letter_queue, "order-completed.dead-letter");
    assert_eq!(source.queue_type, QueueType::Quorum);
    assert!(!source.declare);
    assert_eq!(source.table, "pipelines.loyalty.source");
    let older =
        Config::from_toml(Path::new("/etc/idem/pipelines.toml"), VALID).expect("the older form");
    assert_eq!(rabbitmq(&older.pipelines[0]).table, "pipelines.loyalty");
    assert_eq!(older.pipelines[0].queue(), "order-completed");

    check_error(
        &(VALID.to_string()
            + "\n[pipelines.loyalty.source]\nkind = \"rabbitmq\"\nqueue = \"other\"\n"),
        &[
            "line 15",
            "pipelines.loyalty.source",
            "inside [pipelines.<name>.source]",
        ],
    );
    check_error(
        &VALID.replace("queue = \"order-completed\"\n", ""),
        &["pipelines.loyalty: no source", "kind = \"rabbitmq\""],
    );
    check_error(
        &(VALID.replace("queue = \"order-completed\"\n", "")
            + "\n[pipelines.loyalty.source]\nkind = \"rabbitmq\"\n"),
        &["pipelines.loyalty.source.queue", "missing"],
    );
    check_error(
        &(VALID.replace("queue = \"order-completed\"\n", "")
            + "\n[pipelines.loyalty.source]\nkind = \"mqtt\"\nqueue = \"q\"\n"),
        &["mqtt", "rabbitmq", "kafka"],
    );
    check_error(
        &(VALID.replace("queue = \"order-completed\"\n", "")
            + "\n[pipelines.loyalty.source]\nkind = \"rabbitmq\"\nqueue = \"q\"\ndead_letter_queue = \"q\"\n"),
        &[
            "line 16",
            "pipelines.loyalty.source.dead_letter_queue",
            "must differ",
        ],
    );
}

/// A Kafka source: its defaults, its checks, and the keys of the other kinds refused.
#[test]
fn a_kafka_source() {
    let kafka = |keys: &str| {
        VALID.replace("queue = \"order-completed\"\n", "")
            + "\n[pipelines.loyalty.source]\nkind = \"kafka\"\n"
            + keys
    };
    let config = Config::from_toml(
        Path::new("/etc/idem/pipelines.toml"),
        &kafka("brokers = [\"127.0.0.1:9092\"]\ntopic = \"orders\"\nproperties = { \"session.timeout.ms\" = 6000, \"check.crcs\" = true }\n"),
    )
    .expect("a Kafka source");
    let pipeline = &config.pipelines[0];
    let SourceConfig::Kafka(source) = &pipeline.source else {
        panic!("not Kafka: {:?}", pipeline.source);
    };
    assert_eq!(source.group, "idem-loyalty");
    assert_eq!(source.topics, ["orders"]);
    assert_eq!(source.dead_letter_topic, "orders.dead-letter");
    assert_eq!(source.ordering, Ordering::Key);
    assert_eq!(source.start, KafkaStart::Window);
    assert_eq!(source.assignment, Assignment::Range);
    assert_eq!(source.revoke_timeout, Duration::from_secs(10));
    assert!(source.declare);
    assert_eq!(source.properties["session.timeout.ms"], "6000");
    assert_eq!(source.properties["check.crcs"], "true");
    assert_eq!(pipeline.queue(), "orders");
    assert_eq!(pipeline.source_kind(), "kafka");

    let listed = Config::from_toml(
        Path::new("/etc/idem/pipelines.toml"),
        &kafka("brokers = [\"b1:9092\", \"b2:9092\"]\ntopic = [\"a\", \"b\"]\ndead_letter_topic = \"rejected\"\nordering = \"partition\"\nstart = \"earliest\"\nassignment = \"cooperative-sticky\"\n"),
    )
    .expect("several topics");
    let SourceConfig::Kafka(source) = &listed.pipelines[0].source else {
        panic!("not Kafka");
    };
    assert_eq!(source.topics, ["a", "b"]);
    assert_eq!(source.start, KafkaStart::Earliest);
    assert_eq!(source.assignment, Assignment::CooperativeSticky);

    check_error(
        &kafka("topic = \"orders\"\n"),
        &["pipelines.loyalty.source.brokers", "missing"],
    );
    check_error(
        &kafka("brokers = [\"b:9092\"]\ntopic = [\"a\", \"b\"]\n"),
        &["dead_letter_topic", "several topics"],
    );
    check_error(
        &kafka("brokers = [\"b:9092\"]\ntopic = \"orders\"\ndead_letter_topic = \"orders\"\n"),
        &["dead_letter_topic", "other than the consumed"],
    );
    check_error(
        &kafka("brokers = [\"b:9092\"]\ntopic = \"orders.*\"\n"),
        &["pipelines.loyalty.source.topic", "pattern"],
    );
    check_error(
        &kafka("brokers = [\"b:9092\"]\ntopic = \"orders\"\nstart = \"all\"\n"),
        &["start", "JetStream's"],
    );
    check_error(
        &kafka(
            "brokers = [\"b:9092\"]\ntopic = \"orders\"\nproperties = { \"group.id\" = \"x\" }\n",
        ),
        &["properties", "group.id", "use group"],
    );
    check_error(
        &kafka("brokers = [\"b:9092\"]\ntopic = \"orders\"\nstream = \"ORDERS\"\n"),
        &[
            "pipelines.loyalty.source.stream",
            "a JetStream setting",
            "Kafka source",
        ],
    );
    check_error(
        &kafka(
            "brokers = [\"b:9092\"]\ntopic = \"orders\"\nsasl = { mechanism = \"GSSAPI\", username = \"u\", password = \"p\" }\n",
        ),
        &["GSSAPI"],
    );
    let jetstream = VALID.replace("queue = \"order-completed\"\n", "")
        + "\n[pipelines.loyalty.source]\nkind = \"jetstream\"\nservers = [\"nats://127.0.0.1:4222\"]\nstream = \"ORDERS\"\n";
    check_error(
        &(jetstream.clone() + "start = \"earliest\"\n"),
        &["start", "Kafka's"],
    );
    check_error(
        &(jetstream + "group = \"g\"\n"),
        &["pipelines.loyalty.source.group", "a Kafka setting"],
    );
}

#[track_caller]
fn check_error(text: &str, fragments: &[&str]) {
    let error = Config::from_toml(Path::new("/etc/idem/pipelines.toml"), text)
        .expect_err("config should be refused")
        .to_string();
    assert!(error.contains("/etc/idem/pipelines.toml"), "{error}");
    for fragment in fragments {
        assert!(error.contains(fragment), "{error:?} lacks {fragment:?}");
    }
}

#[test]
fn defaults_and_resolution() {
    let config =
        Config::from_toml(Path::new("/etc/idem/pipelines.toml"), VALID).expect("valid config");
    let pipeline = config.pipeline("loyalty").expect("pipeline loyalty");
    assert_eq!(pipeline.consumer, "loyalty");
    assert_eq!(pipeline.dead_letter(), "order-completed.dead-letter");
    assert_eq!(pipeline.plugin, Path::new("/etc/idem/plugins/loyalty.wasm"));
    assert_eq!(pipeline.claim, ClaimMode::Ledger);
    assert_eq!(pipeline.limits, PluginLimits::default());
    assert_eq!(pipeline.statements.len(), 1);
    assert_eq!(
        pipeline.batch.latency, None,
        "batches take up to size by default"
    );
    let adaptive = format!("{VALID}\n[pipelines.loyalty.batch]\nsize = 256\nlatency = \"10ms\"\n");
    let config = Config::from_toml(Path::new("/etc/idem/pipelines.toml"), &adaptive)
        .expect("an adaptive batch size");
    let batch = config.pipeline("loyalty").expect("pipeline loyalty").batch;
    assert_eq!(batch.latency, Some(Duration::from_millis(10)));
    check_error(
        &format!("{VALID}\n[pipelines.loyalty.batch]\nlatency = \"soon\"\n"),
        &["line 16", "latency", "not a duration"],
    );
}

#[test]
fn errors_name_line_and_key() {
    check_error(
        &VALID.replace("queue = ", "queue_name = "),
        &["line 9", "unknown field `queue_name`"],
    );
    check_error(
        &VALID.replace("plugin = ", "workers = 0\nplugin = "),
        &["line 10", "workers"],
    );
    check_error(
        &VALID.replace(
            "[pipelines.loyalty]\n",
            "[pipelines.loyalty]\nclaim = \"redis\"\n",
        ),
        &["line 9", "claim", "ledger"],
    );
    check_error(
        &VALID.replace("credit = \"UPDATE", "credit = \"  \"\nx = \"UPDATE"),
        &["line 13", "pipelines.loyalty.statements.credit", "empty"],
    );
    check_error(
        &VALID.replace("\"order-completed\"", "\"${IDEM_TEST_UNSET_QUEUE}\""),
        &["line 9", "IDEM_TEST_UNSET_QUEUE is not set"],
    );
    check_error("[amqp]\nurl = \"x\"\n", &["missing field `database`"]);
    check_error(
        &format!("{VALID}\n[http]\nlisten = \"0.0.0.0:9464\"\n"),
        &["http.admin_token: required"],
    );
    check_error(
        &format!("{VALID}\n[http]\nadmin_token = \"s3cret\"\n"),
        &["line 15", "http.admin_token", "at least 32 characters"],
    );
    check_error(
        &format!(
            "{VALID}\n[http]\nlisten = \"127.0.0.1:9464\"\nmetrics_listen = \"127.0.0.1:9464\"\n"
        ),
        &[
            "line 15",
            "http.metrics_listen",
            "an address (or port) of its own",
        ],
    );
    for (retry, key) in [
        ("initial = \"0s\"", "pipelines.loyalty.retry.initial"),
        (
            "initial = \"10s\"\nmax = \"1s\"",
            "pipelines.loyalty.retry.max",
        ),
        ("multiplier = 0.5", "pipelines.loyalty.retry.multiplier"),
        ("jitter = 1.5", "pipelines.loyalty.retry.jitter"),
    ] {
        check_error(
            &format!("{VALID}\n[pipelines.loyalty.retry]\n{retry}\n"),
            &["line 15", key],
        );
    }
    check_error(
        &format!("{VALID}\n[http]\nhosts = [\"idem.internal:9464\"]\n"),
        &["line 15", "http.hosts", "not a host name"],
    );
    check_error(
        &format!("{VALID}\n[traces]\notlp_endpoint = \"collector:4317\"\n"),
        &[
            "line 15",
            "traces.otlp_endpoint",
            "not an http:// or https:// URL",
        ],
    );
    check_error(
        &format!("{VALID}\n[traces]\nprotocol = \"http/json\"\n"),
        &[
            "line 16",
            "protocol = \"http/json\"",
            "grpc",
            "http/protobuf",
        ],
    );
}

/// `[traces]`: absent is off; the endpoint and protocol as written.
/// A config with only `[database]` loads (for `idem migrate`); `idem run` needs a pipeline.
#[test]
fn a_database_only_config_loads_and_is_not_runnable() {
    let config = Config::from_toml(
        Path::new("/etc/idem/db.toml"),
        "[database]\nurl = \"postgres://db/orders\"\n",
    )
    .expect("a database-only config");
    assert!(config.pipelines.is_empty());
    let error = config
        .require_pipelines()
        .expect_err("not runnable")
        .to_string();
    assert!(
        error.contains("/etc/idem/db.toml") && error.contains("no pipelines"),
        "{error}"
    );
}

/// The metrics listener may face the network without a token while `listen` stays on
/// loopback.
#[test]
fn a_metrics_listener_needs_no_token() {
    let text = format!("{VALID}\n[http]\nmetrics_listen = \"0.0.0.0:9465\"\n");
    let config = Config::from_toml(Path::new("p.toml"), &text).expect("config");
    let http = config.http.expect("[http]");
    assert_eq!(
        http.metrics_listen,
        Some("0.0.0.0:9465".parse().expect("address"))
    );
    assert!(http.listen.ip().is_loopback());
    assert_eq!(http.admin_token, None);
}

#[test]
fn a_traces_table() {
    let config = Config::from_toml(Path::new("/etc/idem/pipelines.toml"), VALID).expect("valid");
    assert_eq!(config.traces, None);
    let config = Config::from_toml(
        Path::new("/etc/idem/pipelines.toml"),
        &format!(
            "{VALID}\n[traces]\notlp_endpoint = \"http://collector:4317\"\nprotocol = \"grpc\"\n"
        ),
    )
    .expect("valid");
    assert_eq!(
        config.traces,
        Some(TracesConfig {
            otlp_endpoint: Some("http://collector:4317".into()),
            protocol: Some(OtlpProtocol::Grpc),
        })
    );
}

#[test]
fn connectivity_settings_are_checked() {
    let tls = |url: &str, table: &str| {
        VALID.replace(
            "[amqp]\nurl = \"amqp://127.0.0.1\"\n",
            &format!("[amqp]\nurl = \"{url}\"\n\n[amqp.tls]\n{table}\n"),
        )
    };
    check_error(
        &tls("amqp://127.0.0.1", "ca_file = \"ca.pem\""),
        &["line 5", "amqp.tls", "not amqps://"],
    );
    check_error(
        &tls("amqps://127.0.0.1", "cert_file = \"client.pem\""),
        &["amqp.tls", "cert_file and key_file go together"],
    );
    check_error(
        &VALID.replace("amqp://127.0.0.1", "http://127.0.0.1"),
        &["amqp.url", "is not an AMQP URL"],
    );
    // A cluster: a list of nodes, each checked; one scheme for all.
    let cluster =
        |urls: &str| VALID.replace("url = \"amqp://127.0.0.1\"", &format!("url = {urls}"));
    let config = Config::from_toml(
        Path::new("/etc/idem/pipelines.toml"),
        &cluster("[\"amqp://u:secret@node-1\", \"amqp://u:secret@node-2:5673/%2f\"]"),
    )
    .expect("a list of nodes");
    let broker = &rabbitmq(&config.pipelines[0]).broker;
    assert_eq!(broker.urls.len(), 2);
    assert_eq!(broker.endpoints(), "amqp://node-1, amqp://node-2:5673/%2f");
    check_error(&cluster("[]"), &["amqp.url", "at least one"]);
    check_error(
        &cluster("[\"amqp://node-1\", \"http://node-2\"]"),
        &["amqp.url", "\"http://node-2\" is not an AMQP URL"],
    );
    check_error(
        &cluster("[\"amqp://node-1\", \"amqps://node-2\"]"),
        &["amqp.url", "all amqps:// (TLS) or all amqp://"],
    );
    let config = Config::from_toml(
        Path::new("/etc/idem/pipelines.toml"),
        &tls("amqps://127.0.0.1", "ca_file = \"ca.pem\""),
    )
    .expect("amqps with a CA");
    // [amqp] is resolved into each RabbitMQ source (and AMQP destination) that uses it.
    let broker = &rabbitmq(&config.pipelines[0]).broker;
    assert_eq!(broker.urls, ["amqps://127.0.0.1"]);
    assert_eq!(
        broker.tls.as_ref().and_then(|tls| tls.ca_file.clone()),
        Some(PathBuf::from("/etc/idem/ca.pem"))
    );
    let config = Config::from_toml(
        Path::new("/etc/idem/pipelines.toml"),
        &format!("{VALID}\n[outbox.destinations.audit]\nkind = \"amqp\"\nexchange = \"audit\"\n"),
    )
    .expect("an AMQP destination");
    let outbox = config.outbox.expect("outbox");
    assert!(matches!(
        outbox.destinations.get("audit"),
        Some(Destination::Amqp { broker, exchange, .. }) if broker.urls == ["amqp://127.0.0.1"] && exchange == "audit"
    ));

    let queue = |keys: &str| {
        VALID.replace(
            "plugin = \"plugins/loyalty.wasm\"\n",
            &format!("plugin = \"plugins/loyalty.wasm\"\n{keys}\n"),
        )
    };
    check_error(
        &queue("declare = false\nqueue_arguments = { \"x-delivery-limit\" = 5 }"),
        &[
            "line 12",
            "pipelines.loyalty.queue_arguments",
            "declare = false",
        ],
    );
    check_error(
        &queue("queue_arguments = { \"x-queue-type\" = \"quorum\" }"),
        &["pipelines.loyalty.queue_arguments", "queue_type"],
    );
    check_error(&queue("queue_type = \"stream\""), &["queue_type", "quorum"]);
    let config = Config::from_toml(
        Path::new("/etc/idem/pipelines.toml"),
        &queue("queue_type = \"quorum\"\nqueue_arguments = { \"x-delivery-limit\" = 5 }"),
    )
    .expect("a quorum queue");
    let source = rabbitmq(&config.pipelines[0]);
    assert_eq!(source.queue_type, QueueType::Quorum);
    assert_eq!(
        source.queue_arguments.get("x-delivery-limit"),
        Some(&QueueArgument::Integer(5))
    );

    let destination =
        |keys: &str| format!("{VALID}\n[outbox.destinations.hook]\nkind = \"http\"\n{keys}\n");
    check_error(
        &destination("url = \"ftp://example.com\""),
        &["outbox.destinations.hook.url", "http:// or https://"],
    );
    check_error(
        &destination("url = \"http://example.com\"\nca_file = \"ca.pem\""),
        &["outbox.destinations.hook.ca_file", "https://"],
    );
    let config = Config::from_toml(
        Path::new("/etc/idem/pipelines.toml"),
        &destination("url = \"https://example.com\"\nca_file = \"ca.pem\""),
    )
    .expect("an https destination");
    let outbox = config.outbox.expect("outbox");
    assert!(matches!(
        outbox.destinations.get("hook"),
        Some(Destination::Http { ca_file: Some(path), .. }) if path == Path::new("/etc/idem/ca.pem")
    ));
}

#[test]
fn the_schema_names_every_table_and_pipeline_key() {
    let schema = json_schema();
    let properties = |value: &serde_json::Value| -> Vec<String> {
        value["properties"]
            .as_object()
            .map(|object| object.keys().cloned().collect())
            .unwrap_or_default()
    };
    let top = properties(&schema);
    for table in [
        "database",
        "amqp",
        "http",
        "pipelines",
        "outbox",
        "plugin_pool",
        "traces",
    ] {
        assert!(
            top.contains(&table.to_string()),
            "{table} missing from {top:?}"
        );
    }
    assert_eq!(schema["additionalProperties"], false);
    let pipeline = &schema["$defs"]["RawPipeline"];
    let keys = properties(pipeline);
    for key in [
        "queue",
        "plugin",
        "claim",
        "statements",
        "cases",
        "self_test",
        "limits",
    ] {
        assert!(
            keys.contains(&key.to_string()),
            "{key} missing from {keys:?}"
        );
    }
    assert_eq!(pipeline["additionalProperties"], false);
    assert_eq!(
        pipeline["required"],
        serde_json::json!(["plugin", "statements"])
    );
    let source = &schema["$defs"]["RawSource"];
    assert_eq!(source["required"], serde_json::json!(["kind"]));
    assert_eq!(source["additionalProperties"], false);
    let window = &schema["$defs"]["RetentionConfig"]["properties"]["window"];
    assert_eq!(window["type"], "string", "{window}");
    assert!(
        !schema.to_string().contains("\"default\""),
        "defaults are described, not generated"
    );
}

/// `[database] url` as libpq reads it: one host or a list, each host a URL of its own, and
/// whether only a host that takes writes will do.
#[test]
fn a_database_url_may_list_hosts() {
    let with_url = |url: &str| VALID.replace("postgres://127.0.0.1/db", url);
    let hosts = |url: &str| {
        Config::from_toml(Path::new("/etc/idem/pipelines.toml"), &with_url(url))
            .expect("valid config")
            .database
            .hosts()
            .expect("hosts")
    };
    let one = hosts("postgres://idem:secret@db:5432/orders?sslmode=require");
    assert_eq!(
        one.urls,
        ["postgres://idem:secret@db:5432/orders?sslmode=require"]
    );
    assert!(!one.read_write, "one host, no attribute: whatever answers");
    let two = hosts(
        "postgres://idem:secret@db1:5433,db2/orders?sslmode=require&target_session_attrs=read-write",
    );
    assert_eq!(
        two.urls,
        [
            "postgres://idem:secret@db1:5433/orders?sslmode=require",
            "postgres://idem:secret@db2/orders?sslmode=require",
        ]
    );
    assert!(two.read_write);
    assert!(
        hosts("postgres://a,b/db").read_write,
        "the default with a list"
    );
    assert!(!hosts("postgres://a,b/db?target_session_attrs=any").read_write);
    assert!(hosts("postgres://a/db?target_session_attrs=primary").read_write);
    assert_eq!(
        hosts("postgres://[::1]:5432,[::2]:5433/db").urls,
        ["postgres://[::1]:5432/db", "postgres://[::2]:5433/db"]
    );
    check_error(
        &with_url("postgres://a,,b/db"),
        &["line 2", "database.url", "lists an empty host"],
    );
    check_error(
        &with_url("postgres://a,b/db?target_session_attrs=standby"),
        &[
            "database.url",
            "target_session_attrs=standby",
            "read-write, primary or any",
        ],
    );
}

/// `[database] schema`: a plain schema name idem may create, or none.
#[test]
fn a_database_schema_is_a_plain_name() {
    let with_schema = |schema: &str| {
        VALID.replace(
            "url = \"postgres://127.0.0.1/db\"\n",
            &format!("url = \"postgres://127.0.0.1/db\"\nschema = \"{schema}\"\n"),
        )
    };
    let config = Config::from_toml(Path::new("/etc/idem/pipelines.toml"), &with_schema("idem"))
        .expect("valid config");
    assert_eq!(config.database.schema.as_deref(), Some("idem"));
    let default = Config::from_toml(Path::new("/etc/idem/pipelines.toml"), VALID).expect("valid");
    assert_eq!(
        default.database.schema, None,
        "the search path's, as before"
    );
    for (schema, problem) in [
        ("Idem", "not a schema name idem takes"),
        ("", "not a schema name idem takes"),
        ("1idem", "not a schema name idem takes"),
        ("idem.claims", "not a schema name idem takes"),
        ("pg_idem", "PostgreSQL's own schema"),
        ("information_schema", "PostgreSQL's own schema"),
    ] {
        check_error(
            &with_schema(schema),
            &["line 2", "database.schema", problem],
        );
    }
}

/// `[databases.<name>]` tables and a pipeline's `database`: the named database, checked as
/// `[database]` is, and a name that is not one refused naming the key.
#[test]
fn a_pipeline_may_name_another_database() {
    let named = VALID.replace(
        "[amqp]",
        "[databases.billing]\nurl = \"postgres://billing-db/billing\"\nschema = \"idem\"\n\n[amqp]",
    );
    let with_database = |name: &str| {
        named.replace(
            "plugin = \"plugins/loyalty.wasm\"\n",
            &format!("plugin = \"plugins/loyalty.wasm\"\ndatabase = \"{name}\"\n"),
        )
    };
    let config = Config::from_toml(
        Path::new("/etc/idem/pipelines.toml"),
        &with_database("billing"),
    )
    .expect("valid config");
    let pipeline = &config.pipelines[0];
    assert_eq!(pipeline.database.as_deref(), Some("billing"));
    assert_eq!(
        config.database_of(pipeline).url,
        "postgres://billing-db/billing"
    );
    assert_eq!(
        config
            .all_databases()
            .map(|(name, database)| (name, database.schema.as_deref()))
            .collect::<Vec<_>>(),
        [(None, None), (Some("billing"), Some("idem"))]
    );
    assert_eq!(config.pipelines_in(Some("billing")).len(), 1);
    assert!(config.pipelines_in(None).is_empty());
    let default = Config::from_toml(Path::new("/etc/idem/pipelines.toml"), &named).expect("valid");
    assert_eq!(
        default.database_of(&default.pipelines[0]).url,
        "postgres://127.0.0.1/db"
    );
    check_error(
        &with_database("ledger"),
        &[
            "pipelines.loyalty.database",
            "\"ledger\" is not a [databases.<name>] table",
            "billing",
        ],
    );
    check_error(
        &VALID.replace(
            "plugin = \"plugins/loyalty.wasm\"\n",
            "plugin = \"plugins/loyalty.wasm\"\ndatabase = \"billing\"\n",
        ),
        &[
            "pipelines.loyalty.database",
            "there is no [databases.<name>] table",
        ],
    );
    check_error(
        &named.replace("schema = \"idem\"", "schema = \"Idem\""),
        &["databases.billing.schema", "not a schema name"],
    );
}

/// A statement that would change idem's pooled session beyond its transaction is refused,
/// naming the statement, its line and the change (review finding 10).
#[test]
fn a_statement_that_changes_the_session_is_refused() {
    check_error(
        &(VALID.to_string() + "tenant = \"SELECT set_config('search_path', $1, false)\"\n"),
        &[
            "line 14",
            "pipelines.loyalty.statements.tenant",
            "changes the session",
            "set_config(…, true)",
        ],
    );
    check_error(
        &(VALID.to_string() + "role = \"SET ROLE app\"\n"),
        &["pipelines.loyalty.statements.role", "SET without LOCAL"],
    );
    Config::from_toml(
        Path::new("/etc/idem/pipelines.toml"),
        &(VALID.to_string() + "role = \"SET LOCAL ROLE app\"\n"),
    )
    .expect("a transaction's own role");
}

/// Every key of `[pipelines.<name>.source]` belongs to exactly one kind's keys, but `declare`,
/// which both read: a key added to the table and forgotten by its kind would be accepted by
/// the other kind without a word.
#[test]
fn every_source_key_belongs_to_one_kind() {
    let schema = serde_json::to_value(schemars::schema_for!(source::RawSource)).expect("schema");
    let mut table: Vec<String> = schema["properties"]
        .as_object()
        .expect("properties")
        .keys()
        .filter(|key| *key != "kind")
        .cloned()
        .collect();
    table.sort();
    let kinds = [
        source::rabbitmq::RabbitMqKeys::KEYS.as_slice(),
        source::jetstream::JetStreamKeys::KEYS.as_slice(),
        source::kafka::KafkaKeys::KEYS.as_slice(),
    ];
    let mut read: Vec<String> = kinds
        .iter()
        .flat_map(|keys| keys.iter())
        .map(|key| key.to_string())
        .collect();
    read.sort();
    read.dedup();
    assert_eq!(table, read, "the table's keys and the kinds' keys differ");
    // The keys more than one kind reads, and no other: a key added to a second kind by
    // mistake would be taken silently by both.
    let mut shared: Vec<&str> = read
        .iter()
        .filter(|key| {
            kinds
                .iter()
                .filter(|keys| keys.contains(&key.as_str()))
                .count()
                > 1
        })
        .map(String::as_str)
        .collect();
    shared.sort();
    assert_eq!(shared, ["declare", "start", "tls"]);
}
