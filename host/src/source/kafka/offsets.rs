//! Where a Kafka consumer resumes: per partition, the offset below which every message
//! received is settled (applied, a duplicate, or dead-lettered). Offsets are only that;
//! exactly once comes from the claim. A partition's commit never passes a message whose
//! transaction has not committed, and never goes back.
//!
//! Each assignment of a partition is an epoch: a settlement carrying an older epoch (a
//! message of an assignment revoked or lost since) is refused, so a late ack cannot move the
//! offset of a partition this host no longer owns, or owns anew.

use std::collections::{BTreeMap, BTreeSet};

/// A partition of a topic.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Partition {
    pub topic: String,
    pub partition: i32,
}

impl Partition {
    pub fn new(topic: impl Into<String>, partition: i32) -> Self {
        Partition {
            topic: topic.into(),
            partition,
        }
    }
}

impl std::fmt::Display for Partition {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "{}[{}]", self.topic, self.partition)
    }
}

/// One assigned partition's messages received and not settled.
#[derive(Debug)]
struct Assigned {
    epoch: u64,
    /// One past the highest offset received (where reading began, before any).
    next: i64,
    /// Received, not settled.
    open: BTreeSet<i64>,
    /// The offset last committed (or where the assignment began).
    committed: i64,
}

impl Assigned {
    /// The offset to resume from: the lowest not settled, or one past everything received.
    fn floor(&self) -> i64 {
        self.open.first().copied().unwrap_or(self.next)
    }
}

/// The settled floors of every partition assigned to this consumer.
#[derive(Debug, Default)]
pub struct Floors {
    assigned: BTreeMap<Partition, Assigned>,
    epochs: u64,
}

impl Floors {
    /// `partition` is this consumer's from `start` (its committed offset, or where a new
    /// group begins); returns the assignment's epoch.
    pub fn assign(&mut self, partition: Partition, start: i64) -> u64 {
        self.epochs += 1;
        let assigned = Assigned {
            epoch: self.epochs,
            next: start,
            open: BTreeSet::new(),
            committed: start,
        };
        self.assigned.insert(partition, assigned);
        self.epochs
    }

    /// The epoch of `partition`'s assignment, if it is assigned.
    pub fn epoch(&self, partition: &Partition) -> Option<u64> {
        self.assigned.get(partition).map(|assigned| assigned.epoch)
    }

    /// A message at `offset` was received in assignment `epoch`; `false` when that
    /// assignment is over (the message is not this consumer's to settle).
    pub fn received(&mut self, partition: &Partition, epoch: u64, offset: i64) -> bool {
        match self.assigned.get_mut(partition) {
            Some(assigned) if assigned.epoch == epoch => {
                // Below the floor: read again after a seek back; it is open again.
                assigned.next = assigned.next.max(offset + 1);
                assigned.open.insert(offset);
                true
            }
            _ => false,
        }
    }

    /// The message at `offset` is settled; `false` (nothing changes) when its assignment is
    /// over: a late settlement of a partition revoked or lost meanwhile.
    pub fn settled(&mut self, partition: &Partition, epoch: u64, offset: i64) -> bool {
        match self.assigned.get_mut(partition) {
            Some(assigned) if assigned.epoch == epoch => assigned.open.remove(&offset),
            _ => false,
        }
    }

    /// Messages received and not settled, over every partition (or one).
    pub fn open(&self, partition: Option<&Partition>) -> usize {
        self.assigned
            .iter()
            .filter(|(assigned, _)| partition.is_none_or(|partition| partition == *assigned))
            .map(|(_, assigned)| assigned.open.len())
            .sum()
    }

    /// The offsets to commit now: each partition whose floor moved past its last commit.
    pub fn to_commit(&self) -> Vec<(Partition, i64)> {
        self.assigned
            .iter()
            .filter(|(_, assigned)| assigned.floor() > assigned.committed)
            .map(|(partition, assigned)| (partition.clone(), assigned.floor()))
            .collect()
    }

    /// The broker took the commit of `offset` for `partition` (a commit never goes back).
    pub fn committed(&mut self, partition: &Partition, offset: i64) {
        if let Some(assigned) = self.assigned.get_mut(partition) {
            assigned.committed = assigned.committed.max(offset);
        }
    }

    /// The floor of `partition` now, when assigned.
    pub fn floor(&self, partition: &Partition) -> Option<i64> {
        self.assigned.get(partition).map(Assigned::floor)
    }

    /// `partition` is revoked or lost: its assignment ends (later settlements are refused).
    /// Returns its floor, for the last commit of a revoke (a lost one commits nothing).
    pub fn release(&mut self, partition: &Partition) -> Option<i64> {
        self.assigned
            .remove(partition)
            .map(|assigned| assigned.floor())
    }

    /// The partitions assigned now.
    pub fn partitions(&self) -> impl Iterator<Item = &Partition> {
        self.assigned.keys()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn orders(partition: i32) -> Partition {
        Partition::new("orders", partition)
    }

    #[test]
    fn the_floor_waits_for_the_lowest_message_not_settled() {
        let mut floors = Floors::default();
        let epoch = floors.assign(orders(0), 10);
        for offset in 10..15 {
            assert!(floors.received(&orders(0), epoch, offset));
        }
        assert_eq!(floors.to_commit(), vec![]);
        // 11, 12 and 14 settle first: nothing below 10 is open, but 10 is.
        for offset in [11, 12, 14] {
            assert!(floors.settled(&orders(0), epoch, offset));
        }
        assert_eq!(floors.floor(&orders(0)), Some(10));
        assert_eq!(floors.to_commit(), vec![]);
        assert!(floors.settled(&orders(0), epoch, 10));
        // 13 is still open: resume there, never past it.
        assert_eq!(floors.to_commit(), vec![(orders(0), 13)]);
        floors.committed(&orders(0), 13);
        assert_eq!(floors.to_commit(), vec![]);
        assert!(floors.settled(&orders(0), epoch, 13));
        assert_eq!(floors.to_commit(), vec![(orders(0), 15)]);
    }

    #[test]
    fn gaps_in_offsets_do_not_hold_the_floor() {
        // Compacted topics and transaction markers leave offsets no message has.
        let mut floors = Floors::default();
        let epoch = floors.assign(orders(1), 0);
        for offset in [0, 3, 7] {
            floors.received(&orders(1), epoch, offset);
        }
        for offset in [0, 3, 7] {
            floors.settled(&orders(1), epoch, offset);
        }
        assert_eq!(floors.to_commit(), vec![(orders(1), 8)]);
    }

    #[test]
    fn a_settlement_from_an_earlier_assignment_is_refused() {
        let mut floors = Floors::default();
        let first = floors.assign(orders(2), 0);
        floors.received(&orders(2), first, 0);
        floors.received(&orders(2), first, 1);
        assert_eq!(floors.release(&orders(2)), Some(0));
        // Assigned again (after a rebalance) from the committed offset: the old delivery's
        // late ack must not settle offset 0 of the new assignment.
        let second = floors.assign(orders(2), 0);
        assert_ne!(first, second);
        floors.received(&orders(2), second, 0);
        assert!(!floors.settled(&orders(2), first, 0));
        assert_eq!(floors.floor(&orders(2)), Some(0));
        assert!(floors.settled(&orders(2), second, 0));
        assert_eq!(floors.floor(&orders(2)), Some(1));
        // And a partition no longer assigned takes nothing.
        floors.release(&orders(2));
        assert!(!floors.received(&orders(2), second, 1));
        assert!(!floors.settled(&orders(2), second, 1));
    }

    #[test]
    fn a_commit_never_goes_back() {
        let mut floors = Floors::default();
        let epoch = floors.assign(orders(3), 100);
        floors.received(&orders(3), epoch, 100);
        floors.settled(&orders(3), epoch, 100);
        floors.committed(&orders(3), 101);
        // A message read again below the committed offset (a seek back) opens it, and the
        // floor drops, but nothing is committed below what the broker has.
        floors.received(&orders(3), epoch, 100);
        assert_eq!(floors.floor(&orders(3)), Some(100));
        assert_eq!(floors.to_commit(), vec![]);
        floors.committed(&orders(3), 50);
        floors.settled(&orders(3), epoch, 100);
        assert_eq!(floors.to_commit(), vec![]);
        assert_eq!(floors.open(None), 0);
    }
}
