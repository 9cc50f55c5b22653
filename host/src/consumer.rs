//! The consume loop of one pipeline, over any [`Source`]: consumes its queue (reconnecting
//! with backoff), feeds deliveries to bounded workers in batches, has `process` decide and
//! apply them, then has each delivery settled with its broker (ack, dead-letter, retry or
//! requeue) after its transaction. Names no broker.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::backoff::{Backoff, Schedule};
use crate::batch_size::BatchSize;
use crate::failpoint::Failpoint;
use crate::message::InboundMessage;
use crate::pipeline::Pipeline;
use crate::process::{self, Disposition};
use crate::source::{self, Delivery, ForKind, Source, SourceError};

/// Consumes `pipeline`'s queue or stream until `shutdown`, whatever its kind (see
/// [`consume`]).
pub fn consume_pipeline(
    pipeline: Arc<Pipeline>,
    shutdown: CancellationToken,
) -> Pin<Box<dyn Future<Output = Result<(), SourceError>> + Send>> {
    struct Consume(Arc<Pipeline>, CancellationToken);
    impl ForKind for Consume {
        type Output = Pin<Box<dyn Future<Output = Result<(), SourceError>> + Send>>;

        fn run<S: Source>(self, config: &S::Config) -> Self::Output {
            Box::pin(consume::<S>(self.0, config.clone(), self.1))
        }
    }
    let chooser = Arc::clone(&pipeline);
    source::for_kind(&chooser.config, Consume(pipeline, shutdown))
}

/// Consumes the pipeline's queue from source `S`, configured by `config`, until `shutdown`,
/// reconnecting with backoff. Returns an error only for a refusal no retry can fix
/// (credentials, vhost, TLS, a queue declared otherwise): the host must stop and say which
/// setting to change.
pub async fn consume<S: Source>(
    pipeline: Arc<Pipeline>,
    config: S::Config,
    shutdown: CancellationToken,
) -> Result<(), SourceError> {
    let name = pipeline.config.name.clone();
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    while !shutdown.is_cancelled() {
        if pipeline.operator_pause().is_some() {
            // Paused by an operator: no connection, nothing held, until resumed.
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                () = pipeline.operator_resumed() => {}
            }
            continue;
        }
        let opened = tokio::select! {
            opened = S::open(&config, &pipeline.config, &shutdown) => opened,
            () = shutdown.cancelled() => return Ok(()),
        };
        let lost = match opened {
            Ok(source) => {
                info!(pipeline = %name, queue = %pipeline.config.queue(), "Consuming.");
                backoff.reset();
                pipeline.consuming.store(true, Ordering::Relaxed);
                let served = serve(&pipeline, source, &shutdown).await;
                pipeline.consuming.store(false, Ordering::Relaxed);
                match served {
                    Ok(Ended::Shutdown) => return Ok(()),
                    Ok(Ended::OperatorPause) => {
                        info!(pipeline = %name, "Stopped consuming: paused by an operator.");
                        continue;
                    }
                    Err(error) => error,
                }
            }
            Err(error) if error.is_refused() => return Err(error),
            Err(error) => error,
        };
        let delay = backoff.next_delay();
        warn!(
            pipeline = %name,
            error = %lost,
            retry_in_ms = delay.as_millis() as u64,
            "{} unavailable; reconnecting.",
            S::BROKER
        );
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.cancelled() => return Ok(()),
        }
    }
    Ok(())
}

/// Why [`serve`] stopped consuming without an error.
enum Ended {
    Shutdown,
    /// An operator paused the pipeline.
    OperatorPause,
}

/// Feeds deliveries to at most `workers` concurrent tasks, up to the batch size (`batch.size`,
/// or adapting with `batch.latency`, see `batch_size`) per task, gathered for at most
/// `batch.linger`. On shutdown or an operator's pause, stops
/// consuming, lets every started message finish and settle, then closes the connection (what
/// was prefetched and not started goes back to the queue).
async fn serve<S: Source>(
    pipeline: &Arc<Pipeline>,
    mut source: S,
    shutdown: &CancellationToken,
) -> Result<Ended, SourceError> {
    let workers = Arc::new(Semaphore::new(pipeline.config.workers.get()));
    let batch_size = Arc::new(BatchSize::new(&pipeline.config.batch));
    pipeline
        .metrics
        .batch_size(pipeline.name(), batch_size.current());
    let mut in_flight = JoinSet::new();
    let ended = loop {
        while in_flight.try_join_next().is_some() {}
        if pipeline.paused().is_some() {
            // A configuration fault: take nothing more until the paused transaction works.
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break Ok(Ended::Shutdown),
                () = pipeline.operator_paused() => break Ok(Ended::OperatorPause),
                () = pipeline.unpaused() => {}
            }
        }
        let next = tokio::select! {
            biased;
            () = shutdown.cancelled() => break Ok(Ended::Shutdown),
            () = pipeline.operator_paused() => break Ok(Ended::OperatorPause),
            next = source.next() => next,
        };
        let first = match next {
            Ok(delivery) => delivery,
            Err(error) => break Err(error),
        };
        let permit = tokio::select! {
            permit = workers.clone().acquire_owned() => permit,
            // The delivery is not started: closing the connection returns it to the queue.
            () = shutdown.cancelled() => break Ok(Ended::Shutdown),
        };
        let Ok(permit) = permit else {
            break Ok(Ended::Shutdown);
        };
        // A batch's time runs from here: waiting for a free worker is waiting in the queue,
        // which a smaller batch would not shorten.
        let started = Instant::now();
        let limit = batch_size.current();
        let linger = pipeline.config.batch.linger;
        let (deliveries, gathering_ended) =
            gather(&mut source, first, limit, linger, shutdown).await;
        let pipeline = Arc::clone(pipeline);
        let shutdown = shutdown.clone();
        let batch_size = Arc::clone(&batch_size);
        in_flight.spawn(async move {
            let messages = deliveries.len();
            settle_batch(&pipeline, deliveries, &shutdown).await;
            batch_size.settled(messages, started.elapsed());
            pipeline
                .metrics
                .batch_size(pipeline.name(), batch_size.current());
            drop(permit);
        });
        if let Some(error) = gathering_ended {
            break Err(error);
        }
    };
    if ended.is_ok() {
        source.stop().await;
    }
    while in_flight.join_next().await.is_some() {}
    source.close().await;
    ended
}

/// `first` and what else `source` delivers, up to `limit` deliveries, waiting at most
/// `linger` after the first (0: only what is delivered already). Stops early at shutdown;
/// a source error ends the gathering, and is handed back beside what was gathered.
async fn gather<S: Source>(
    source: &mut S,
    first: S::Delivery,
    limit: usize,
    linger: Duration,
    shutdown: &CancellationToken,
) -> (Vec<S::Delivery>, Option<SourceError>) {
    let mut deliveries = vec![first];
    let deadline = tokio::time::Instant::now() + linger;
    while deliveries.len() < limit {
        let next = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            next = tokio::time::timeout_at(deadline, source.next()) => next,
        };
        match next {
            Err(_linger_elapsed) => break,
            Ok(Ok(delivery)) => deliveries.push(delivery),
            Ok(Err(error)) => return (deliveries, Some(error)),
        }
    }
    (deliveries, None)
}

/// Decides the fate of a batch of deliveries (one transaction), then tells the broker:
/// rejections, retries and requeues first, then the acks.
async fn settle_batch(
    pipeline: &Pipeline,
    deliveries: Vec<impl Delivery>,
    shutdown: &CancellationToken,
) {
    let received_at = Instant::now();
    let dispositions = if let [delivery] = &deliveries[..] {
        vec![
            process::handle_delivery(pipeline, delivery.message(), delivery.attempt(), shutdown)
                .await,
        ]
    } else {
        let inputs: Vec<(&InboundMessage, u32)> = deliveries
            .iter()
            .map(|delivery| (delivery.message(), delivery.attempt()))
            .collect();
        process::handle_batch(pipeline, &inputs, shutdown).await
    };
    let mut acks = Vec::new();
    for (delivery, disposition) in deliveries.iter().zip(dispositions) {
        let outcome = disposition.outcome();
        if let Disposition::Ack(settled) = disposition {
            debug!(pipeline = %pipeline.config.name, outcome = settled.as_str(), "Settled.");
            acks.push((delivery, outcome));
            continue;
        }
        let done = tell_broker(pipeline, delivery, disposition).await;
        report(pipeline, delivery, outcome, done, received_at);
    }
    // Acks that leave together can be folded into one (RabbitMQ's `multiple`).
    let acked = acks.iter().map(|(delivery, _)| delivery.ack());
    let acked = futures::future::join_all(acked).await;
    for ((delivery, outcome), done) in acks.iter().zip(acked) {
        Failpoint::AfterAck.hit();
        report(pipeline, *delivery, outcome, done, received_at);
    }
}

/// Counts a settled delivery, and says so when its connection was gone.
fn report(
    pipeline: &Pipeline,
    delivery: &impl Delivery,
    outcome: &'static str,
    done: bool,
    received_at: Instant,
) {
    pipeline
        .metrics
        .message_settled(&pipeline.config.name, outcome, received_at.elapsed());
    if !done {
        warn!(
            pipeline = %pipeline.config.name,
            delivery = %delivery.describe(),
            "Could not settle the delivery: its connection is gone. The broker will redeliver it; the claim makes that a duplicate."
        );
    }
}

/// Carries out a disposition other than a plain ack. Returns whether the broker got it.
async fn tell_broker(
    pipeline: &Pipeline,
    delivery: &impl Delivery,
    disposition: Disposition,
) -> bool {
    let name = &pipeline.config.name;
    match disposition {
        Disposition::Ack(_) => delivery.ack().await,
        Disposition::DeadLetter { error_kind, reason } => {
            warn!(
                pipeline = %name,
                error_kind,
                %reason,
                message_id = delivery.message().message_id.as_deref().unwrap_or(""),
                dead_letter_queue = %pipeline.config.dead_letter(),
                "Message rejected and dead-lettered."
            );
            delivery.dead_letter(error_kind, &reason).await
        }
        Disposition::Retry { attempt, reason } => {
            let delay = retry_delay(attempt);
            debug!(pipeline = %name, attempt, %reason, delay_ms = delay.as_millis() as u64, "Plugin asked for a retry.");
            delivery.retry(attempt, delay).await
        }
        Disposition::Requeue => delivery.requeue().await,
    }
}

/// The waits before a message's retryable failure is tried again: 200 ms before its second
/// try, doubling per try, at most 10 s.
const RETRIES: Schedule = Schedule::new(Duration::from_millis(200), Duration::from_secs(10));

/// The wait before try `attempt` (2 for the first retry).
fn retry_delay(attempt: u32) -> Duration {
    RETRIES.delay(attempt.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_wait_longer_each_time_up_to_ten_seconds() {
        let waits: Vec<u128> = (2..=9)
            .map(|attempt| retry_delay(attempt).as_millis())
            .collect();
        assert_eq!(waits, [200, 400, 800, 1_600, 3_200, 6_400, 10_000, 10_000]);
    }
}
