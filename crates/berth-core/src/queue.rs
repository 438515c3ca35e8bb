//! One FIFO band of the host queue (foreground or background).
//!
//! Lookups are logarithmic: order is a `BTreeMap` keyed by a per-band sequence number,
//! positions come from a Fenwick tree over the same sequence numbers, and the A6 scan
//! window is a rotating cursor, so no operation walks the whole queue.

use std::collections::BTreeMap;

pub(crate) type Slot = u32;

/// Order statistics over append-only sequence numbers: `rank(seq)` is how many live
/// entries have a smaller sequence number. A Fenwick tree over `seq - base`; when the
/// dead prefix grows past the live span the tree is rebuilt from `base = first live`,
/// which keeps memory proportional to the live span and costs amortised O(1) per entry.
#[derive(Clone, Debug, Default)]
pub(crate) struct RankIndex {
    base: u64,
    /// 1-based Fenwick array; `tree[0]` unused.
    tree: Vec<u32>,
}

impl RankIndex {
    fn prefix(&self, mut i: usize) -> u32 {
        // Sum of positions 1..=i.
        let mut sum = 0;
        while i > 0 {
            sum += self.tree[i];
            i &= i - 1;
        }
        sum
    }

    fn add(&mut self, mut i: usize, delta: i32) {
        while i < self.tree.len() {
            self.tree[i] = (self.tree[i] as i64 + delta as i64) as u32;
            i += i & i.wrapping_neg();
        }
    }

    /// `seq` must be larger than every sequence number inserted before.
    fn insert(&mut self, seq: u64) {
        if self.tree.is_empty() {
            self.tree.push(0);
        }
        let pos = (seq - self.base + 1) as usize;
        while self.tree.len() <= pos {
            // A new node covers (j - lowbit(j), j]; everything in it but j itself is
            // already in the tree, so its value is a difference of prefixes.
            let j = self.tree.len();
            let low = j & j.wrapping_neg();
            let value = self.prefix(j - 1) - self.prefix(j - low);
            self.tree.push(value);
        }
        self.add(pos, 1);
    }

    fn remove(&mut self, seq: u64) {
        let pos = (seq - self.base + 1) as usize;
        self.add(pos, -1);
    }

    fn rank(&self, seq: u64) -> u64 {
        let pos = (seq - self.base) as usize; // entries strictly before seq
        self.prefix(pos.min(self.tree.len().saturating_sub(1))) as u64
    }

    fn rebuild<'a>(&mut self, live: impl Iterator<Item = &'a u64>, base: u64) {
        self.base = base;
        self.tree.clear();
        for &seq in live {
            self.insert(seq);
        }
    }

    fn span(&self) -> usize {
        self.tree.len().saturating_sub(1)
    }
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Queue {
    items: BTreeMap<u64, Slot>,
    rank: RankIndex,
    next_seq: u64,
    /// Where the next scan window starts (A6). Rotates from pass to pass.
    cursor: Option<u64>,
}

impl Queue {
    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub(crate) fn push(&mut self, slot: Slot) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.items.insert(seq, slot);
        self.rank.insert(seq);
        seq
    }

    pub(crate) fn remove(&mut self, seq: u64) {
        let removed = self.items.remove(&seq);
        assert!(removed.is_some(), "queue entry {seq} missing");
        self.rank.remove(seq);
        if let Some((&first, _)) = self.items.first_key_value() {
            let dead = (first - self.rank.base) as usize;
            if dead > 1024 && dead > self.rank.span() / 2 {
                self.rank.rebuild(self.items.keys(), first);
            }
        } else {
            self.rank.rebuild(std::iter::empty(), self.next_seq);
        }
    }

    pub(crate) fn head(&self) -> Option<(u64, Slot)> {
        self.items.first_key_value().map(|(&s, &r)| (s, r))
    }

    /// 0-based position of `seq` in this band.
    pub(crate) fn rank(&self, seq: u64) -> u64 {
        self.rank.rank(seq)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, Slot)> + '_ {
        self.items.iter().map(|(&s, &r)| (s, r))
    }

    /// The next `window` waiters after the head, starting at the rotating cursor and
    /// wrapping around to just after the head. Advances the cursor past the last one.
    pub(crate) fn window(&mut self, window: usize, out: &mut Vec<(u64, Slot)>) {
        out.clear();
        let Some((head, _)) = self.head() else {
            self.cursor = None;
            return;
        };
        let start = match self.cursor {
            Some(c) if c > head => c,
            _ => head + 1,
        };
        out.extend(
            self.items
                .range(start..)
                .take(window)
                .map(|(&s, &r)| (s, r)),
        );
        if out.len() < window && start > head + 1 {
            let more = window - out.len();
            out.extend(
                self.items
                    .range(head + 1..start)
                    .take(more)
                    .map(|(&s, &r)| (s, r)),
            );
        }
        self.cursor = out.last().map(|&(s, _)| s + 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_match_order_after_random_removals() {
        let mut q = Queue::default();
        let mut seqs = Vec::new();
        for i in 0..5000u32 {
            seqs.push(q.push(i));
        }
        // Remove a deterministic pseudo-random two thirds, including the whole front,
        // so the index rebuilds at least once.
        for (i, &s) in seqs.iter().enumerate() {
            if i < 2000 || (i * 7919) % 3 != 0 {
                q.remove(s);
            }
        }
        for (expected, (seq, _)) in q.iter().enumerate() {
            assert_eq!(q.rank(seq), expected as u64);
        }
        for i in 0..100u32 {
            q.push(10_000 + i);
        }
        for (expected, (seq, _)) in q.iter().enumerate() {
            assert_eq!(q.rank(seq), expected as u64);
        }
    }

    #[test]
    fn window_rotates_and_wraps_after_the_head() {
        let mut q = Queue::default();
        for i in 0..10u32 {
            q.push(i);
        }
        let mut w = Vec::new();
        q.window(4, &mut w);
        assert_eq!(w.iter().map(|x| x.1).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
        q.window(4, &mut w);
        assert_eq!(w.iter().map(|x| x.1).collect::<Vec<_>>(), vec![5, 6, 7, 8]);
        q.window(4, &mut w);
        assert_eq!(w.iter().map(|x| x.1).collect::<Vec<_>>(), vec![9, 1, 2, 3]);
    }
}
