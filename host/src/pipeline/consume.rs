//! The consume loop of one pipeline, over any [`Source`]: consumes its queue (reconnecting
//! with backoff), feeds deliveries to bounded workers in batches, has `process` decide and
//! apply them, then has each delivery settled with its broker (ack, dead-letter, retry or
//! requeue) after its transaction. Names no broker.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::backoff::Backoff;
use crate::failpoint::Failpoint;
use crate::message::InboundMessage;
use crate::pipeline::Pipeline;
use crate::pipeline::batch_size::BatchSize;
use crate::pipeline::process::{self, Disposition};
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
            opened = S::open(&config, &pipeline.config, &pipeline.lent, &shutdown) => opened,
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
                    Ok(Ended::FaultPause) => {
                        tokio::select! {
                            () = shutdown.cancelled() => return Ok(()),
                            () = pipeline.unpaused() => {}
                            () = pipeline.operator_paused() => {}
                            () = tokio::time::sleep(RETRY_AFTER_RELEASE) => {}
                        }
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
    /// A configuration fault paused it for longer than [`RELEASE_AFTER`].
    FaultPause,
}

/// How long a pipeline paused by a configuration fault keeps what it prefetched before it
/// stops consuming and gives it back to the queue: long enough for a fault that clears at
/// once (a table swapped by a migration) not to churn the queue, short enough that healthy
/// hosts do not idle while this one holds messages it cannot apply.
const RELEASE_AFTER: Duration = Duration::from_secs(5);

/// How long a pipeline that gave its messages back waits, while still paused, before it
/// consumes again to try anew: the transaction that kept trying may have given up (a stop,
/// a conflict past its budget), and only a message can tell whether the fault is gone.
const RETRY_AFTER_RELEASE: Duration = Duration::from_secs(30);

/// Feeds deliveries to at most `workers` concurrent tasks (with `batch.latency`, at most
/// [`BATCHES_AT_ONCE_FOR_LATENCY`] of them gathering several messages), up to the batch size
/// (`batch.size`, or adapting with `batch.latency`, see `batch_size`) per task, gathered for
/// at most `batch.linger`. On shutdown or an operator's pause, stops consuming, lets every
/// started message finish and settle, then closes the connection (what was prefetched and
/// not started goes back to the queue).
async fn serve<S: Source>(
    pipeline: &Arc<Pipeline>,
    mut source: S,
    shutdown: &CancellationToken,
) -> Result<Ended, SourceError> {
    let workers = Workers::for_pipeline(&pipeline.config);
    let batch_size = Arc::new(BatchSize::new(&pipeline.config.batch));
    pipeline
        .metrics
        .batch_size(pipeline.name(), batch_size.current());
    let mut in_flight = JoinSet::new();
    let mut probe_taken = false;
    let ended = loop {
        while in_flight.try_join_next().is_some() {}
        let alone = match before_next(pipeline, shutdown, &mut probe_taken).await {
            Ok(alone) => alone,
            Err(ended) => break Ok(ended),
        };
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
        // The delivery is not started at shutdown: it goes back at once (a JetStream message
        // on its last delivery is dead-lettered rather than abandoned).
        let Some(worker) = workers.take(&batch_size, shutdown).await else {
            first.give_back().await;
            break Ok(Ended::Shutdown);
        };
        // A batch's time runs from here: waiting for a free worker is waiting in the queue,
        // which a smaller batch would not shorten.
        let started = Instant::now();
        let limit = if alone { 1 } else { worker.limit };
        let linger = pipeline.config.batch.linger;
        let (deliveries, gathering_ended) =
            gather(&mut source, first, limit, linger, shutdown).await;
        let pipeline = Arc::clone(pipeline);
        let shutdown = shutdown.clone();
        let batch_size = Arc::clone(&batch_size);
        in_flight.spawn(async move {
            let messages = deliveries.len();
            settle_batch(&pipeline, deliveries, &shutdown).await;
            if let Some(size) = batch_size.settled(messages, started.elapsed()) {
                pipeline.metrics.batch_size(pipeline.name(), size);
            }
            drop(worker);
        });
        if let Some(error) = gathering_ended {
            break Err(error);
        }
    };
    if ended.is_ok() {
        source.stop().await;
        // What was prefetched and not started goes back now, to other hosts (a JetStream
        // message on its last delivery is dead-lettered rather than abandoned).
        let given = source.give_back().await;
        if matches!(ended, Ok(Ended::FaultPause)) {
            warn!(
                pipeline = %pipeline.name(),
                given_back = given,
                "Paused by a configuration fault: stopped consuming and gave the prefetched messages back; one transaction keeps trying."
            );
        }
    }
    while in_flight.join_next().await.is_some() {}
    source.close().await;
    ended
}

/// Before the next delivery: whether it is to be taken alone, to find out whether a
/// configuration fault that paused the pipeline is gone (no transaction keeps trying: each
/// gave its messages back), or why consuming ends. While one transaction keeps trying,
/// nothing more is taken, and after `RELEASE_AFTER` what was prefetched goes back.
async fn before_next(
    pipeline: &Pipeline,
    shutdown: &CancellationToken,
    probe_taken: &mut bool,
) -> Result<bool, Ended> {
    if pipeline.paused().is_none() {
        *probe_taken = false;
        return Ok(false);
    }
    if !pipeline.probing() && !*probe_taken {
        *probe_taken = true;
        return Ok(true);
    }
    tokio::select! {
        biased;
        () = shutdown.cancelled() => Err(Ended::Shutdown),
        () = pipeline.operator_paused() => Err(Ended::OperatorPause),
        () = pipeline.unpaused() => {
            *probe_taken = false;
            Ok(false)
        }
        () = tokio::time::sleep(RELEASE_AFTER) => Err(Ended::FaultPause),
    }
}

/// With `batch.latency` set, how many multi-message batches are gathered at once. They
/// apply one at a time (`Pipeline::batch_applier`: two in parallel would deadlock on shared
/// rows), so beyond one applying and one ready behind it a batch gathered now only waits for
/// that lock, its messages' latency growing while they could have joined a later batch: two
/// at once halve a batch's time at the same size. Without a latency target every worker
/// gathers: more batches overlap their plugin calls and acks with the one applying, which
/// measured up to a sixth more throughput at the largest sizes (bench/RESULTS.md).
const BATCHES_AT_ONCE_FOR_LATENCY: usize = 2;

/// The pipeline's workers: `workers` tasks at once, of which at most `batches` gather more
/// than one message.
struct Workers {
    tasks: Arc<Semaphore>,
    batches: Arc<Semaphore>,
}

/// A worker taken: the task's permit and, for a batch of several messages, its batch slot.
struct Worker {
    /// The most messages its batch gathers (1 without a batch slot).
    limit: usize,
    _task: OwnedSemaphorePermit,
    _batch: Option<OwnedSemaphorePermit>,
}

impl Workers {
    fn new(workers: usize, batches: usize) -> Workers {
        Workers {
            tasks: Arc::new(Semaphore::new(workers)),
            batches: Arc::new(Semaphore::new(batches)),
        }
    }

    /// A pipeline's workers: every one may gather a batch, unless a latency target asks for
    /// at most [`BATCHES_AT_ONCE_FOR_LATENCY`].
    fn for_pipeline(config: &crate::config::PipelineConfig) -> Workers {
        let workers = config.workers.get();
        let batches = match config.batch.latency {
            Some(_) => workers.min(BATCHES_AT_ONCE_FOR_LATENCY),
            None => workers,
        };
        Workers::new(workers, batches)
    }

    /// Waits for a free worker (and, while batches take more than one message, a batch
    /// slot); `None` at shutdown.
    async fn take(&self, batch_size: &BatchSize, shutdown: &CancellationToken) -> Option<Worker> {
        let acquire = async {
            let task = self.tasks.clone().acquire_owned().await.ok()?;
            if batch_size.current() == 1 {
                return Some(Worker {
                    limit: 1,
                    _task: task,
                    _batch: None,
                });
            }
            let batch = self.batches.clone().acquire_owned().await.ok()?;
            Some(Worker {
                // The size may have changed while the slot was awaited.
                limit: batch_size.current(),
                _task: task,
                _batch: Some(batch),
            })
        };
        tokio::select! {
            worker = acquire => worker,
            () = shutdown.cancelled() => None,
        }
    }
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
            let delay = pipeline.config.retry.delay(attempt);
            debug!(pipeline = %name, attempt, %reason, delay_ms = delay.as_millis() as u64, "Plugin asked for a retry.");
            delivery.retry(attempt, delay).await
        }
        Disposition::Requeue => delivery.requeue().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four workers limited to two batches take four single messages at once, but only two
    /// batches: a third batch waits until one of them settles.
    #[tokio::test]
    async fn two_batches_at_once_whatever_the_workers() {
        let shutdown = CancellationToken::new();
        let workers = Workers::new(4, BATCHES_AT_ONCE_FOR_LATENCY);
        let config = |size: usize| crate::config::BatchConfig {
            size: std::num::NonZeroUsize::new(size).expect("a size"),
            ..Default::default()
        };
        let singles = BatchSize::new(&config(1));
        let mut taken = Vec::new();
        for _ in 0..4 {
            let worker = workers.take(&singles, &shutdown).await.expect("a worker");
            assert_eq!(worker.limit, 1);
            taken.push(worker);
        }
        taken.clear();
        let batches = BatchSize::new(&config(64));
        let first = workers.take(&batches, &shutdown).await.expect("a worker");
        let second = workers.take(&batches, &shutdown).await.expect("a worker");
        assert_eq!((first.limit, second.limit), (64, 64));
        let third =
            tokio::time::timeout(Duration::from_millis(50), workers.take(&batches, &shutdown))
                .await;
        assert!(third.is_err(), "a third batch was gathered");
        let single = workers.take(&singles, &shutdown).await;
        assert_eq!(
            single.map(|worker| worker.limit),
            Some(1),
            "singles still run"
        );
        drop(first);
        let third =
            tokio::time::timeout(Duration::from_millis(50), workers.take(&batches, &shutdown))
                .await;
        assert!(
            matches!(third, Ok(Some(_))),
            "a batch settled, another may start"
        );
        shutdown.cancel();
        assert!(workers.take(&batches, &shutdown).await.is_none());
    }
}
