//! The journal's readers (D5): the recent entries in memory, the rest from the ledger,
//! and a signal for live streams.
//!
//! The daemon writes every entry into the ledger in the transaction of its change and,
//! once that commit is durable, publishes it here (on the ledger thread, in commit
//! order, so entries arrive here in sequence order without gaps). Readers never wait
//! for the daemon: recent entries come from a ring in memory, older ones from the
//! ledger between commits. Live readers wait on a signal that carries no entries, only
//! the last number published: raised once per commit, after all of that commit's
//! entries are in the ring, so each reader wakes once per commit and takes them all
//! at once. The publisher never waits on a reader and holds nothing for it, so a slow
//! reader never slows admission: it falls behind, is told so in a last event and may
//! resume by sequence number.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use berth_store::{JournalEntry, LedgerReader, StoreError, JOURNAL_READ_MAX};
use tokio::sync::{oneshot, watch};

/// Recent entries kept in memory, so resuming readers and `GET /v1/journal` rarely
/// reach the ledger thread (~300 bytes each: ~2.5 MiB).
pub const JOURNAL_RING_MAX: usize = 8_192;
/// How far a live reader may fall behind (entries) before it is cut off: within the
/// ring, so a live reader that keeps up within it never costs the ledger a read.
pub const SUBSCRIBER_LAG_MAX: usize = 4_096;

struct Ring {
    /// Consecutive entries, the newest last.
    entries: VecDeque<Arc<JournalEntry>>,
    /// The last entry published (or restored from the ledger at start).
    last: u64,
}

pub struct Journal {
    ring: Mutex<Ring>,
    /// The last entry live readers were told of.
    live: watch::Sender<u64>,
    ledger: OnceLock<LedgerReader>,
    /// Exports under way: retention keeps their ranges while they are read.
    holds: Arc<Holds>,
}

/// Exports one daemon streams at once (S10, issue 32 finding 3): each holds at most
/// about 1 MiB, and its range of the journal against retention while it lasts.
pub const EXPORTS_MAX: usize = 8;

/// The exports under way, by ticket, with the first entry each reads; `floor` is the
/// lowest of them (`u64::MAX`: none), which the ledger's retention reads.
#[derive(Default)]
struct Holds {
    by_ticket: Mutex<(u64, BTreeMap<u64, u64>)>,
    floor: Arc<AtomicU64>,
}

impl Holds {
    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, BTreeMap<u64, u64>)> {
        self.by_ticket.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_floor(&self, held: &BTreeMap<u64, u64>) {
        let floor = held.values().copied().min().unwrap_or(u64::MAX);
        self.floor.store(floor, Ordering::Release);
    }
}

/// An export's hold on the journal from its first entry: retention deletes nothing at
/// or after it until this is dropped.
pub struct Hold {
    holds: Arc<Holds>,
    ticket: u64,
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut g = self.holds.lock();
        g.1.remove(&self.ticket);
        self.holds.set_floor(&g.1);
    }
}

impl Default for Journal {
    fn default() -> Journal {
        Journal {
            ring: Mutex::new(Ring {
                entries: VecDeque::new(),
                last: 0,
            }),
            live: watch::channel(0).0,
            ledger: OnceLock::new(),
            holds: Arc::new(Holds {
                by_ticket: Mutex::default(),
                floor: Arc::new(AtomicU64::new(u64::MAX)),
            }),
        }
    }
}

impl Journal {
    /// At start: the ledger's last entry, and how to read older ones.
    pub fn start(&self, last: u64, ledger: LedgerReader) {
        let mut ring = self.lock();
        ring.entries.clear();
        ring.last = last;
        let _ = self.ledger.set(ledger);
        self.live.send_replace(last);
    }

    /// What the ledger's retention reads: the first entry an export still needs.
    pub fn hold_floor(&self) -> Arc<AtomicU64> {
        self.holds.floor.clone()
    }

    /// Holds the journal from `first` on for an export, or `None` when `EXPORTS_MAX`
    /// exports are under way already.
    pub fn hold(&self, first: u64) -> Option<Hold> {
        let mut g = self.holds.lock();
        if g.1.len() >= EXPORTS_MAX {
            return None;
        }
        g.0 += 1;
        let ticket = g.0;
        g.1.insert(ticket, first);
        self.holds.set_floor(&g.1);
        Some(Hold {
            holds: self.holds.clone(),
            ticket,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Durable entries, in sequence order (called once their commit is durable). Read
    /// at once; live readers learn of them at the next [`Journal::wake`].
    pub fn publish(&self, entries: Vec<Arc<JournalEntry>>) {
        // The entries the ring lets go are dropped after the lock is released.
        let mut evicted = Vec::new();
        let mut ring = self.lock();
        for e in entries {
            debug_assert_eq!(e.seq, ring.last + 1, "journal entries arrive in order");
            ring.last = e.seq;
            if ring.entries.len() == JOURNAL_RING_MAX {
                evicted.extend(ring.entries.pop_front());
            }
            ring.entries.push_back(e);
        }
        drop(ring);
        drop(evicted);
    }

    /// Wakes the live readers if anything was published since they were last woken
    /// (once per commit). Never blocks: a reader too far behind finds out when it reads.
    pub fn wake(&self) {
        let last = self.last();
        self.live
            .send_if_modified(|told| std::mem::replace(told, last) != last);
    }

    /// The last durable entry's sequence number.
    pub fn last(&self) -> u64 {
        self.lock().last
    }

    /// The signal of new entries: it changes when entries past what it last said are
    /// published. Mark it seen before reading, then read: nothing falls between.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.live.subscribe()
    }

    /// Entries after `after`, in order, at most `limit` (and `JOURNAL_READ_MAX`).
    pub async fn read(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Arc<JournalEntry>>, StoreError> {
        let limit = limit.min(JOURNAL_READ_MAX);
        {
            let ring = self.lock();
            if after >= ring.last || limit == 0 {
                return Ok(Vec::new());
            }
            if let Some(front) = ring.entries.front() {
                if after + 1 >= front.seq {
                    let skip = (after + 1 - front.seq) as usize;
                    return Ok(ring
                        .entries
                        .iter()
                        .skip(skip)
                        .take(limit)
                        .cloned()
                        .collect());
                }
            }
        }
        let got = self.ask_ledger(move |s| s.journal(after, limit)).await?;
        Ok(got.into_iter().map(Arc::new).collect())
    }

    /// The first entry retention has kept (0: none).
    pub async fn first(&self) -> Result<u64, StoreError> {
        self.ask_ledger(|s| s.journal_first()).await
    }

    async fn ask_ledger<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn berth_store::Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let Some(ledger) = self.ledger.get() else {
            return Err(StoreError::Stopped);
        };
        let (tx, rx) = oneshot::channel();
        ledger.read(f, move |r| {
            let _ = tx.send(r);
        });
        rx.await.unwrap_or(Err(StoreError::Stopped))
    }
}

/// What a reader wants (the wire's one filter, for the ledger's entries).
pub use berth_client::wire::JournalFilter as Filter;

/// Whether `f` wants the ledger entry `e`.
pub fn admits(f: &Filter, e: &JournalEntry) -> bool {
    f.admits(e.run_id.as_deref(), e.project.as_deref(), &e.kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64) -> JournalEntry {
        JournalEntry {
            seq,
            kind: if seq.is_multiple_of(2) {
                "granted"
            } else {
                "queued"
            }
            .into(),
            run_id: Some(format!("r{}", seq % 3)),
            project: None,
            line: format!("{{\"seq\":{seq}}}"),
        }
    }

    /// Readers get consecutive entries from the ring, across its wrap-around; live
    /// readers are woken once for everything published since they were last woken,
    /// and not again until more is.
    #[tokio::test]
    async fn the_ring_serves_recent_entries_and_readers_wake_once_per_commit() {
        let j = Journal::default();
        let mut live = j.subscribe();
        live.borrow_and_update();
        let n = (JOURNAL_RING_MAX + 10) as u64;
        j.publish((1..=n / 2).map(|q| Arc::new(entry(q))).collect());
        j.publish((n / 2 + 1..=n).map(|q| Arc::new(entry(q))).collect());
        assert_eq!(j.last(), n);
        assert!(!live.has_changed().unwrap(), "published, not yet woken");
        j.wake();
        assert!(live.has_changed().unwrap());
        assert_eq!(*live.borrow_and_update(), n);
        j.wake();
        assert!(!live.has_changed().unwrap(), "nothing new: no second wake");
        let got = j.read(n - 5, 100).await.unwrap();
        assert_eq!(
            got.iter().map(|e| e.seq).collect::<Vec<_>>(),
            (n - 4..=n).collect::<Vec<_>>()
        );
        assert!(j.read(n, 100).await.unwrap().is_empty());
        let oldest_in_ring = n - JOURNAL_RING_MAX as u64 + 1;
        assert_eq!(
            j.read(oldest_in_ring - 1, 1).await.unwrap()[0].seq,
            oldest_in_ring
        );
        // Older than the ring, with no ledger: the read says so rather than skipping.
        assert!(j.read(1, 10).await.is_err());
    }

    #[test]
    fn filters_match_run_project_and_kind() {
        let f = Filter {
            run: Some("r1".into()),
            project: None,
            kinds: vec!["queued".into()],
        };
        assert!(admits(&f, &entry(1)));
        assert!(!admits(&f, &entry(4)), "r1 but granted");
        assert!(!admits(&f, &entry(3)), "queued but r0");
        assert!(admits(&Filter::default(), &entry(2)));
    }
}
