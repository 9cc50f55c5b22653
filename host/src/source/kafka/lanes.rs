//! The order a Kafka source hands messages out in. Each message travels in a lane: with
//! `ordering = "key"` a lane is a partition's messages of one key, with `"partition"` a
//! partition, with `"none"` each message is its own. A lane hands out its next message only
//! when the one before is settled, so messages of a lane are applied one at a time in offset
//! order; lanes go on side by side.
//!
//! A message waiting for a retry keeps its lane busy (later messages of its key or partition
//! wait behind it, in order) and no other lane: the other keys go on.

use std::collections::{BTreeMap, VecDeque};

use super::offsets::Partition;
use crate::config::Ordering;

/// Which lane a message travels in.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Lane {
    /// A partition's messages of one key.
    Key(Partition, Vec<u8>),
    /// A partition's messages.
    Partition(Partition),
    /// One message alone: its partition and offset.
    Alone(Partition, i64),
}

impl Lane {
    /// The lane of the message at `offset` of `partition` with `key`, under `ordering`.
    pub fn of(ordering: Ordering, partition: &Partition, key: Option<&[u8]>, offset: i64) -> Lane {
        match (ordering, key) {
            (Ordering::Key, Some(key)) => Lane::Key(partition.clone(), key.to_vec()),
            (Ordering::Partition, _) => Lane::Partition(partition.clone()),
            (Ordering::Key, None) | (Ordering::None, _) => Lane::Alone(partition.clone(), offset),
        }
    }

    pub fn partition(&self) -> &Partition {
        match self {
            Lane::Key(partition, _) | Lane::Partition(partition) | Lane::Alone(partition, _) => {
                partition
            }
        }
    }
}

/// The messages of one lane not handed out yet, and whether one is out.
#[derive(Debug)]
struct Waiting<T> {
    queued: VecDeque<T>,
    busy: bool,
}

/// Messages received and not handed out, by lane, and those ready to hand out now.
#[derive(Debug)]
pub struct Lanes<T> {
    lanes: BTreeMap<Lane, Waiting<T>>,
    ready: VecDeque<(Lane, T)>,
}

impl<T> Default for Lanes<T> {
    fn default() -> Self {
        Lanes {
            lanes: BTreeMap::new(),
            ready: VecDeque::new(),
        }
    }
}

impl<T> Lanes<T> {
    /// A message received, in `lane`: ready at once when its lane is idle, else behind the
    /// lane's earlier messages.
    pub fn push(&mut self, lane: Lane, message: T) {
        let waiting = self.lanes.entry(lane.clone()).or_insert_with(|| Waiting {
            queued: VecDeque::new(),
            busy: false,
        });
        if waiting.busy {
            waiting.queued.push_back(message);
        } else {
            waiting.busy = true;
            self.ready.push_back((lane, message));
        }
    }

    /// The next message to hand out; its lane stays busy until [`settled`](Self::settled).
    pub fn take(&mut self) -> Option<(Lane, T)> {
        self.ready.pop_front()
    }

    /// A message of `lane` handed out is settled: the lane's next message is ready.
    pub fn settled(&mut self, lane: &Lane) {
        let Some(waiting) = self.lanes.get_mut(lane) else {
            return;
        };
        match waiting.queued.pop_front() {
            Some(next) => self.ready.push_back((lane.clone(), next)),
            None => {
                self.lanes.remove(lane);
            }
        }
    }

    /// A message of `lane` handed out comes back (a retry after its delay, a requeue): ready
    /// again before its lane's later messages, its lane still busy.
    pub fn again(&mut self, lane: Lane, message: T) {
        if self.lanes.contains_key(&lane) {
            self.ready.push_back((lane, message));
        }
    }

    /// Drops every message of `partition` not handed out (it was revoked or lost); returns
    /// how many. Messages handed out are settled by their holders; their lanes are gone, so
    /// a late [`again`](Self::again) drops the message too.
    pub fn drop_partition(&mut self, partition: &Partition) -> usize {
        let before = self.waiting();
        self.ready.retain(|(lane, _)| lane.partition() != partition);
        self.lanes.retain(|lane, _| lane.partition() != partition);
        before - self.waiting()
    }

    /// Messages received and not handed out (queued in lanes, or ready).
    pub fn waiting(&self) -> usize {
        self.ready.len()
            + self
                .lanes
                .values()
                .map(|waiting| waiting.queued.len())
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(partition: i32) -> Partition {
        Partition::new("orders", partition)
    }

    /// Pushes `(partition, key, offset)` messages, each carrying its offset.
    fn pushed(ordering: Ordering, messages: &[(i32, Option<&str>, i64)]) -> Lanes<i64> {
        let mut lanes = Lanes::default();
        for (partition, key, offset) in messages {
            let lane = Lane::of(ordering, &part(*partition), key.map(str::as_bytes), *offset);
            lanes.push(lane, *offset);
        }
        lanes
    }

    fn take_all(lanes: &mut Lanes<i64>) -> Vec<(Lane, i64)> {
        std::iter::from_fn(|| lanes.take()).collect()
    }

    #[test]
    fn one_key_waits_for_its_message_before_while_other_keys_go_on() {
        let mut lanes = pushed(
            Ordering::Key,
            &[
                (0, Some("a"), 0),
                (0, Some("b"), 1),
                (0, Some("a"), 2),
                (0, None, 3),
                (0, None, 4),
            ],
        );
        let out = take_all(&mut lanes);
        let offsets: Vec<i64> = out.iter().map(|(_, offset)| *offset).collect();
        // a@0, b@1 and both keyless messages; a@2 waits behind a@0.
        assert_eq!(offsets, vec![0, 1, 3, 4]);
        assert_eq!(lanes.waiting(), 1);
        let (lane_a, _) = out[0].clone();
        lanes.settled(&lane_a);
        assert_eq!(lanes.take().map(|(_, offset)| offset), Some(2));
        assert_eq!(lanes.take(), None);
    }

    #[test]
    fn a_retried_message_holds_its_key_and_only_its_key() {
        let mut lanes = pushed(
            Ordering::Key,
            &[(0, Some("a"), 0), (0, Some("a"), 1), (0, Some("b"), 2)],
        );
        let (lane_a, first) = lanes.take().expect("a@0");
        let (lane_b, _) = lanes.take().expect("b@2");
        // a@0 failed and waits for its retry: b goes on, a@1 does not pass it.
        lanes.settled(&lane_b);
        assert_eq!(lanes.take(), None);
        lanes.again(lane_a.clone(), first);
        assert_eq!(lanes.take(), Some((lane_a.clone(), 0)));
        lanes.settled(&lane_a);
        assert_eq!(lanes.take(), Some((lane_a, 1)));
    }

    #[test]
    fn partition_ordering_is_one_at_a_time_per_partition() {
        let mut lanes = pushed(
            Ordering::Partition,
            &[(0, Some("a"), 0), (0, Some("b"), 1), (1, Some("a"), 0)],
        );
        let out = take_all(&mut lanes);
        assert_eq!(out.len(), 2, "one of partition 0, one of partition 1");
        lanes.settled(&out[0].0);
        assert_eq!(lanes.take().map(|(_, offset)| offset), Some(1));
    }

    #[test]
    fn no_ordering_hands_everything_out() {
        let mut lanes = pushed(
            Ordering::None,
            &[(0, Some("a"), 0), (0, Some("a"), 1), (0, Some("a"), 2)],
        );
        assert_eq!(take_all(&mut lanes).len(), 3);
        assert_eq!(lanes.waiting(), 0);
    }

    #[test]
    fn a_revoked_partition_drops_what_it_had_not_handed_out() {
        let mut lanes = pushed(
            Ordering::Key,
            &[
                (0, Some("a"), 0),
                (0, Some("a"), 1),
                (1, Some("a"), 0),
                (0, Some("c"), 2),
            ],
        );
        let (lane, message) = lanes.take().expect("a@0 of partition 0");
        assert_eq!(lanes.drop_partition(&part(0)), 2, "a@1 queued, c@2 ready");
        // The message handed out before the revoke comes back for a retry: dropped.
        lanes.again(lane, message);
        let left: Vec<(Lane, i64)> = take_all(&mut lanes);
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].0.partition(), &part(1));
    }
}
