//! Small NATS JetStream chores for `bench/throughput.sh`, the counterpart of
//! `bench/reference/queues.py` for RabbitMQ:
//!
//! ```text
//! streams reset STREAM           delete STREAM and STREAM_DEAD_LETTERS, create STREAM empty
//!                                (file storage, capturing STREAM.>)
//! streams depth STREAM CONSUMER  print what CONSUMER has not had acked: pending + unacknowledged
//!                                (every stored message when CONSUMER does not exist)
//! streams count STREAM           print the messages stored in STREAM (0 if it does not exist)
//! streams delete STREAM...       delete each stream if it exists
//! streams version                print the server's name and version
//! ```
//!
//! `NATS_URL` overrides `nats://127.0.0.1:4222`.

use async_nats::jetstream::{self, consumer::pull, stream};

fn fail(message: String) -> ! {
    eprintln!("streams: {message}");
    std::process::exit(1)
}

#[tokio::main]
async fn main() {
    let arguments: Vec<String> = std::env::args().skip(1).collect();
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let client = async_nats::connect(url.as_str())
        .await
        .unwrap_or_else(|error| fail(format!("cannot connect to NATS at {url}: {error}")));
    let context = jetstream::new(client.clone());
    match arguments
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["reset", name] => {
            for stream in [name.to_string(), format!("{name}_DEAD_LETTERS")] {
                delete(&context, &stream).await;
            }
            context
                .create_stream(stream::Config {
                    name: name.to_string(),
                    subjects: vec![format!("{name}.>")],
                    storage: stream::StorageType::File,
                    ..stream::Config::default()
                })
                .await
                .unwrap_or_else(|error| fail(format!("cannot create stream {name}: {error}")));
        }
        ["depth", name, consumer] => {
            let Ok(mut stream) = context.get_stream(*name).await else {
                println!("0");
                return;
            };
            let depth = match stream.get_consumer::<pull::Config>(consumer).await {
                Ok(mut found) => {
                    let info = found.info().await.unwrap_or_else(|error| {
                        fail(format!("cannot read consumer {consumer} on stream {name}: {error}"))
                    });
                    info.num_pending + info.num_ack_pending as u64
                }
                Err(_) => {
                    stream
                        .info()
                        .await
                        .unwrap_or_else(|error| fail(format!("cannot read stream {name}: {error}")))
                        .state
                        .messages
                }
            };
            println!("{depth}");
        }
        ["count", name] => {
            let messages = match context.get_stream(*name).await {
                Ok(mut stream) => stream
                    .info()
                    .await
                    .unwrap_or_else(|error| fail(format!("cannot read stream {name}: {error}")))
                    .state
                    .messages,
                Err(_) => 0,
            };
            println!("{messages}");
        }
        ["delete", names @ ..] if !names.is_empty() => {
            for name in names {
                delete(&context, name).await;
            }
        }
        ["version"] => {
            let info = client.server_info();
            println!("NATS {} ({})", info.version, info.server_name);
        }
        _ => fail(
            "usage: streams reset STREAM | depth STREAM CONSUMER | count STREAM | delete STREAM... | version"
                .into(),
        ),
    }
}

/// Deletes stream `name`; one that does not exist is fine.
async fn delete(context: &jetstream::Context, name: &str) {
    if context.get_stream(name).await.is_ok() {
        context
            .delete_stream(name)
            .await
            .unwrap_or_else(|error| fail(format!("cannot delete stream {name}: {error}")));
    }
}
