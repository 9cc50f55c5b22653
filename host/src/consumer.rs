//! The consume loop of one pipeline: consumes its queue (reconnecting with backoff), feeds
//! deliveries to bounded workers in batches, has `process` decide and apply them, then
//! settles each with the broker (ack, dead-letter, retry or requeue) after its transaction.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::Channel;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::amqp::{self, AmqpError, Receipt, Session};
use crate::backoff::Backoff;
use crate::config::AmqpConfig;
use crate::failpoint::Failpoint;
use crate::message::InboundMessage;
use crate::pipeline::Pipeline;
use crate::process::{self, Disposition};

/// Consumes the pipeline's queue until `shutdown`, reconnecting to RabbitMQ with backoff.
/// Returns an error only for a refusal no retry can fix (credentials, vhost, TLS, a queue
/// declared otherwise): the host must stop and say which setting to change.
pub async fn consume(
    pipeline: Arc<Pipeline>,
    amqp: AmqpConfig,
    shutdown: CancellationToken,
) -> Result<(), AmqpError> {
    let name = pipeline.config.name.clone();
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    while !shutdown.is_cancelled() {
        let opened = tokio::select! {
            opened = Session::open(&amqp, &pipeline.config) => opened,
            () = shutdown.cancelled() => return Ok(()),
        };
        let lost = match opened {
            Ok(session) => {
                info!(pipeline = %name, queue = %pipeline.config.queue, "Consuming.");
                backoff.reset();
                pipeline.consuming.store(true, Ordering::Relaxed);
                let served = serve(&pipeline, session, &shutdown).await;
                pipeline.consuming.store(false, Ordering::Relaxed);
                match served {
                    Ok(()) => return Ok(()),
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
            "RabbitMQ unavailable; reconnecting."
        );
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.cancelled() => return Ok(()),
        }
    }
    Ok(())
}

/// Feeds deliveries to at most `workers` concurrent tasks, up to `batch.size` deliveries per
/// task (gathered for at most `batch.linger`). On shutdown, stops consuming, lets every
/// started message finish and settle, then closes the connection.
async fn serve(
    pipeline: &Arc<Pipeline>,
    mut session: Session,
    shutdown: &CancellationToken,
) -> Result<(), AmqpError> {
    let workers = Arc::new(Semaphore::new(pipeline.config.workers.get()));
    let batch_size = pipeline.config.batch.size.get();
    let mut in_flight = JoinSet::new();
    let lost = |reason: String| AmqpError::ConsumerLost {
        queue: pipeline.config.queue.clone(),
        reason,
    };
    let ended = loop {
        while in_flight.try_join_next().is_some() {}
        if pipeline.paused().is_some() {
            // A configuration fault: take nothing more until the paused transaction works.
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break Ok(()),
                () = pipeline.unpaused() => {}
            }
        }
        let next = tokio::select! {
            biased;
            () = shutdown.cancelled() => break Ok(()),
            next = session.consumer.next() => next,
        };
        let first = match next {
            Some(Ok(delivery)) => delivery,
            Some(Err(error)) => break Err(lost(error.to_string())),
            None => break Err(lost("the broker cancelled the consumer".into())),
        };
        let permit = tokio::select! {
            permit = workers.clone().acquire_owned() => permit,
            // The delivery is not started: closing the connection returns it to the queue.
            () = shutdown.cancelled() => break Ok(()),
        };
        let Ok(permit) = permit else { break Ok(()) };
        let mut deliveries = vec![first];
        let mut gathering_ended = None;
        if batch_size > 1 {
            let deadline = tokio::time::Instant::now() + pipeline.config.batch.linger;
            while deliveries.len() < batch_size {
                let next = tokio::select! {
                    biased;
                    () = shutdown.cancelled() => break,
                    next = tokio::time::timeout_at(deadline, session.consumer.next()) => next,
                };
                match next {
                    Err(_linger_elapsed) => break,
                    Ok(Some(Ok(delivery))) => deliveries.push(delivery),
                    Ok(Some(Err(error))) => {
                        gathering_ended = Some(lost(error.to_string()));
                        break;
                    }
                    Ok(None) => {
                        gathering_ended = Some(lost("the broker cancelled the consumer".into()));
                        break;
                    }
                }
            }
        }
        let received: Vec<(InboundMessage, Receipt)> = deliveries
            .into_iter()
            .map(|delivery| amqp::receive(&pipeline.config.name, delivery, &session.acks))
            .collect();
        let pipeline = Arc::clone(pipeline);
        let channel = session.channel.clone();
        let shutdown = shutdown.clone();
        in_flight.spawn(async move {
            settle_batch(&pipeline, &channel, received, &shutdown).await;
            drop(permit);
        });
        if let Some(error) = gathering_ended {
            break Err(error);
        }
    };
    if ended.is_ok() {
        session.cancel().await;
    }
    while in_flight.join_next().await.is_some() {}
    session.close().await;
    ended
}

/// Decides the fate of a batch of deliveries (one transaction), then tells the broker:
/// rejections, retries and requeues first, then the acks.
async fn settle_batch(
    pipeline: &Pipeline,
    channel: &Channel,
    received: Vec<(InboundMessage, Receipt)>,
    shutdown: &CancellationToken,
) {
    let received_at = Instant::now();
    let dispositions = if let [(message, receipt)] = &received[..] {
        vec![process::handle_delivery(pipeline, message, receipt.attempt, shutdown).await]
    } else {
        let inputs: Vec<(&InboundMessage, u32)> = received
            .iter()
            .map(|(message, receipt)| (message, receipt.attempt))
            .collect();
        process::handle_batch(pipeline, &inputs, shutdown).await
    };
    let mut acks = Vec::new();
    for ((message, receipt), disposition) in received.iter().zip(dispositions) {
        let outcome = disposition.outcome();
        if let Disposition::Ack(settled) = disposition {
            debug!(pipeline = %pipeline.config.name, outcome = settled.as_str(), "Settled.");
            acks.push((receipt, outcome));
            continue;
        }
        let done = tell_broker(pipeline, channel, message, receipt, disposition, shutdown).await;
        report(pipeline, receipt, outcome, done, received_at);
    }
    // The channel's ack owner folds acks that arrive together into `multiple` acks.
    let acked = acks.iter().map(|(receipt, _)| receipt.ack());
    let acked = futures::future::join_all(acked).await;
    for ((receipt, outcome), done) in acks.iter().zip(acked) {
        Failpoint::AfterAck.hit();
        report(pipeline, receipt, outcome, done, received_at);
    }
}

/// Counts a settled delivery, and says so when its channel was gone.
fn report(
    pipeline: &Pipeline,
    receipt: &Receipt,
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
            delivery_tag = receipt.delivery_tag,
            "Could not settle the delivery: its channel is gone. RabbitMQ will redeliver it; the claim makes that a duplicate."
        );
    }
}

/// Carries out a disposition other than a plain ack. Returns whether the broker got it.
async fn tell_broker(
    pipeline: &Pipeline,
    channel: &Channel,
    message: &InboundMessage,
    receipt: &Receipt,
    disposition: Disposition,
    shutdown: &CancellationToken,
) -> bool {
    let name = &pipeline.config.name;
    match disposition {
        Disposition::Ack(_) => receipt.ack().await,
        Disposition::DeadLetter { error_kind, reason } => {
            warn!(
                pipeline = %name,
                error_kind,
                %reason,
                message_id = message.message_id.as_deref().unwrap_or(""),
                dead_letter_queue = %pipeline.config.dead_letter_queue,
                "Message rejected and dead-lettered."
            );
            publish_or_requeue(
                receipt,
                receipt
                    .dead_letter(channel, &pipeline.config, error_kind, &reason)
                    .await,
            )
            .await
        }
        Disposition::Retry { attempt, reason } => {
            let delay = retry_delay(attempt);
            debug!(pipeline = %name, attempt, %reason, delay_ms = delay.as_millis() as u64, "Plugin asked for a retry.");
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = shutdown.cancelled() => {}
            }
            publish_or_requeue(
                receipt,
                receipt
                    .retry(channel, &pipeline.config.queue, attempt)
                    .await,
            )
            .await
        }
        Disposition::Requeue => {
            publish_or_requeue(
                receipt,
                receipt.requeue(channel, &pipeline.config.queue).await,
            )
            .await
        }
    }
}

/// The copy's fate; when the copy could not be published, the original goes back with a
/// `nack` (or, with its channel gone, is redelivered by the broker).
async fn publish_or_requeue(receipt: &Receipt, published: Result<bool, AmqpError>) -> bool {
    match published {
        Ok(acked) => acked,
        Err(error) => {
            warn!(%error, "Cannot move the message; returning it to its queue.");
            receipt.nack_requeue().await
        }
    }
}

/// Delay before a retryable failure is tried again: 200 ms doubling per attempt, at most 10 s.
fn retry_delay(attempt: u32) -> Duration {
    let exponent = attempt.saturating_sub(2).min(6);
    Duration::from_millis(200 * (1u64 << exponent)).min(Duration::from_secs(10))
}
