//! A message from a Kafka partition and how it is settled. Nothing is acknowledged to the
//! broker one message at a time: settling opens the message's lane to the next one and lets
//! its partition's floor pass it (the poll thread commits floors). A dead letter is produced
//! (idempotent, `acks = all`) and its delivery report awaited before the original counts as
//! settled. A retry or a requeue keeps the message here, its lane held, its offset open.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tracing::warn;

use crate::message::InboundMessage;
use crate::source::{Delivery, headers, unix_seconds};

use super::lanes::Lane;
use super::poll::{Held, Shared};

/// A delivery from one of the pipeline's partitions.
pub struct Received {
    held: Held,
    lane: Lane,
    shared: Arc<Shared>,
    producer: FutureProducer,
    /// No longer in a transaction: settled, or set aside for a retry or a requeue. A delivery
    /// dropped before (a worker that panicked) goes back to its lane, so its key does not
    /// wait for ever.
    finished: AtomicBool,
}

impl Received {
    pub(super) fn new(
        held: Held,
        lane: Lane,
        shared: Arc<Shared>,
        producer: FutureProducer,
    ) -> Received {
        Received {
            held,
            lane,
            shared,
            producer,
            finished: AtomicBool::new(false),
        }
    }

    /// Settled: its floor may pass it and its lane's next message is ready. `false` when its
    /// partition was revoked or lost meanwhile (the next owner reads it again, and the claim
    /// makes an applied one a duplicate).
    fn settle(&self) -> bool {
        self.finished.store(true, Ordering::Relaxed);
        let partition = &self.held.partition;
        let mut state = self.shared.lock();
        state.returned(partition);
        let current = state
            .floors
            .settled(partition, self.held.epoch, self.held.offset);
        if current {
            state.lanes.settled(&self.lane);
        }
        drop(state);
        self.shared.settled.notify_all();
        self.shared.ready.notify_one();
        current
    }

    /// Back in its lane after `delay` (at once for none), as try `attempt`; not if the host
    /// stops first: unsettled, its offset is not committed, so it is read again after a
    /// restart.
    fn again_after(&self, delay: Duration, attempt: u32) {
        let (shared, lane, held) = (
            Arc::clone(&self.shared),
            self.lane.clone(),
            self.held.clone(),
        );
        tokio::spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(delay) => {
                    shared.put_back(&lane, &held, attempt);
                }
                () = shared.shutdown.cancelled() => {}
            }
        });
    }

    /// Not in a transaction any more, though not settled: a revoke need not wait for it.
    fn set_aside(&self) {
        self.finished.store(true, Ordering::Relaxed);
        let mut state = self.shared.lock();
        state.returned(&self.held.partition);
        drop(state);
        self.shared.settled.notify_all();
    }

    /// The dead letter's headers: the original's (but the host's own diagnostics), then why,
    /// and where it was read.
    fn dead_letter_headers(&self, error_kind: &str, reason: &str) -> OwnedHeaders {
        let mut headers = OwnedHeaders::new();
        for (name, value) in &self.held.headers {
            if headers::is_kept_on_a_dead_letter(name) {
                headers = headers.insert(Header {
                    key: name,
                    value: value.as_deref(),
                });
            }
        }
        let rejection = headers::Rejection {
            error_kind,
            reason,
            pipeline: &self.shared.pipeline,
            queue: &self.held.partition.topic,
        };
        let whence = [
            (headers::TOPIC, self.held.partition.topic.clone()),
            (
                headers::PARTITION,
                self.held.partition.partition.to_string(),
            ),
            (headers::OFFSET, self.held.offset.to_string()),
            (headers::REJECTED_AT, unix_seconds().to_string()),
        ];
        for (name, value) in rejection.headers().iter().chain(&whence) {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        headers
    }
}

impl Drop for Received {
    fn drop(&mut self) {
        if !self.finished.load(Ordering::Relaxed) {
            warn!(pipeline = %self.shared.pipeline, delivery = %self.describe(), "A Kafka delivery was dropped unsettled; it goes back to its lane.");
            self.set_aside();
            self.shared
                .put_back(&self.lane, &self.held, self.held.attempt);
        }
    }
}

/// How long a dead letter's delivery report may take before the message goes back to its
/// lane, to be tried again.
const DEAD_LETTER_TIMEOUT: Duration = Duration::from_secs(30);

impl Delivery for Received {
    fn message(&self) -> &InboundMessage {
        &self.held.message
    }

    fn attempt(&self) -> u32 {
        self.held.attempt
    }

    fn describe(&self) -> String {
        format!("{} offset {}", self.held.partition, self.held.offset)
    }

    async fn ack(&self) -> bool {
        self.settle()
    }

    async fn dead_letter(&self, error_kind: &'static str, reason: &str) -> bool {
        let mut record = FutureRecord::to(&self.shared.source.dead_letter_topic)
            .payload(&self.held.message.body)
            .headers(self.dead_letter_headers(error_kind, reason));
        if let Some(key) = &self.held.key {
            record = record.key(key);
        }
        match self.producer.send(record, DEAD_LETTER_TIMEOUT).await {
            Ok(_) => self.settle(),
            Err((error, _)) => {
                warn!(
                    pipeline = %self.shared.pipeline,
                    %error,
                    topic = %self.shared.source.dead_letter_topic,
                    "Cannot store the dead letter; the message is tried again in a second."
                );
                self.set_aside();
                self.again_after(Duration::from_secs(1), self.held.attempt);
                false
            }
        }
    }

    async fn retry(&self, attempt: u32, delay: Duration) -> bool {
        self.set_aside();
        self.again_after(delay, attempt);
        true
    }

    async fn requeue(&self) -> bool {
        self.set_aside();
        self.shared
            .put_back(&self.lane, &self.held, self.held.attempt)
    }

    async fn give_back(&self) -> bool {
        self.requeue().await
    }
}
