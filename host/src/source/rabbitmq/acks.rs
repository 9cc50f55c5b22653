//! The one owner of a channel's acknowledgements.
//!
//! Every ack and nack of a channel's deliveries goes through one task, in delivery-tag order.
//! A settled run of tags that starts at the oldest unsettled delivery goes out as one
//! `multiple` ack; a settled tag behind a delivery still in flight is acked alone, so a slow
//! message never holds back the acks of the ones after it (nor, through the prefetch window,
//! the consumer). A `multiple` ack covers every unacked tag up to it, so it must never be sent
//! while an older tag is unsettled, and no tag may be acked twice: both hold because this task
//! alone sends them and forgets a tag once sent. Two places acking raced before (a later
//! batch's `multiple` ack overtook an earlier one and RabbitMQ closed the channel on the
//! second, unknown tag).

use std::collections::BTreeMap;

use lapin::Channel;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use tokio::sync::{mpsc, oneshot};

/// A handle to a channel's ack owner; cheap to clone.
#[derive(Clone, Debug)]
pub struct Acks {
    commands: mpsc::UnboundedSender<Command>,
}

#[derive(Debug)]
enum Command {
    /// A delivery was received: its tag is unsettled until acked or nacked.
    Delivered(u64),
    Ack {
        tag: u64,
        sent: oneshot::Sender<bool>,
    },
    /// A `nack` that puts the delivery back in its queue.
    NackRequeue {
        tag: u64,
        sent: oneshot::Sender<bool>,
    },
}

impl Acks {
    /// Starts the owner of `channel`'s acks; it ends when every handle is dropped.
    pub fn spawn(channel: Channel) -> Acks {
        let (commands, received) = mpsc::unbounded_channel();
        tokio::spawn(own(channel, received));
        Acks { commands }
    }

    /// Records that `tag` was delivered. Call in delivery order, before settling it.
    pub fn delivered(&self, tag: u64) {
        // The owner only ends when every handle is gone, so this cannot fail while `self` lives.
        let _ = self.commands.send(Command::Delivered(tag));
    }

    /// Acks `tag`; `false` when the channel is gone (the broker redelivers the message).
    pub async fn ack(&self, tag: u64) -> bool {
        self.settle(|sent| Command::Ack { tag, sent }).await
    }

    /// Nacks `tag` with requeue; `false` when the channel is gone.
    pub async fn nack_requeue(&self, tag: u64) -> bool {
        self.settle(|sent| Command::NackRequeue { tag, sent }).await
    }

    async fn settle(&self, command: impl FnOnce(oneshot::Sender<bool>) -> Command) -> bool {
        let (sent, outcome) = oneshot::channel();
        if self.commands.send(command(sent)).is_err() {
            return false;
        }
        outcome.await.unwrap_or(false)
    }
}

/// A delivered tag: unsettled (`None`), or acked and waiting to be sent.
type Unsettled = BTreeMap<u64, Option<oneshot::Sender<bool>>>;

async fn own(channel: Channel, mut commands: mpsc::UnboundedReceiver<Command>) {
    let mut tags = Unsettled::new();
    while let Some(command) = commands.recv().await {
        // Everything that arrived meanwhile goes out together.
        let mut nacks = Vec::new();
        let mut next = Some(command);
        while let Some(command) = next {
            match command {
                Command::Delivered(tag) => {
                    tags.insert(tag, None);
                }
                Command::Ack { tag, sent } if unsettled(&tags, tag) => {
                    tags.insert(tag, Some(sent));
                }
                Command::NackRequeue { tag, sent } if unsettled(&tags, tag) => {
                    tags.remove(&tag);
                    nacks.push((tag, sent));
                }
                // Never delivered on this channel, or settled already: settling it again
                // would close the channel.
                Command::Ack { tag, sent } | Command::NackRequeue { tag, sent } => {
                    tracing::warn!(
                        delivery_tag = tag,
                        "A settlement for a delivery that is not outstanding; not sent."
                    );
                    let _ = sent.send(false);
                }
            }
            next = commands.try_recv().ok();
        }
        send(&channel, &mut tags, nacks).await;
    }
}

/// Whether `tag` was delivered and is not settled yet.
fn unsettled(tags: &Unsettled, tag: u64) -> bool {
    matches!(tags.get(&tag), Some(None))
}

/// Sends the nacks, then the acks: the run from the oldest unsettled tag as one `multiple`
/// ack, every other acked tag alone.
async fn send(channel: &Channel, tags: &mut Unsettled, nacks: Vec<(u64, oneshot::Sender<bool>)>) {
    for (tag, sent) in nacks {
        let options = BasicNackOptions {
            requeue: true,
            multiple: false,
        };
        let done = channel.basic_nack(tag, options).await.is_ok();
        let _ = sent.send(done);
    }
    let mut run = Vec::new();
    while let Some(entry) = tags.first_entry()
        && entry.get().is_some()
    {
        let (tag, sent) = entry.remove_entry();
        run.push((tag, sent.expect("checked above")));
    }
    if let Some(&(last, _)) = run.last() {
        let multiple = run.len() > 1;
        let done = channel
            .basic_ack(last, BasicAckOptions { multiple })
            .await
            .is_ok();
        for (_, sent) in run {
            let _ = sent.send(done);
        }
    }
    let behind: Vec<u64> = tags
        .iter()
        .filter(|(_, sent)| sent.is_some())
        .map(|(tag, _)| *tag)
        .collect();
    for tag in behind {
        let Some(Some(sent)) = tags.remove(&tag) else {
            continue;
        };
        let done = channel
            .basic_ack(tag, BasicAckOptions { multiple: false })
            .await
            .is_ok();
        let _ = sent.send(done);
    }
}
