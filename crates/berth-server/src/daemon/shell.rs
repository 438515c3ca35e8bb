//! The thin shell around the daemon: it carries out what a step of the daemon left
//! to be done ([`Effects`]), in order. The daemon decides (what to write, whom to stop,
//! whom to answer and with what); the shell only hands each commit's batch to the
//! ledger writer and, once it is durable, sends its stop orders, its fleet jobs, its
//! journal entries and its answers (D1: nothing is acknowledged before its commit).
//!
//! **Architecture invariant:** the daemon holds no writer and sends no answer itself;
//! every durable change and every reply leaves it as an [`Effect`].

use std::sync::Arc;

use berth_store::{Batch, JournalEntry, StoreError, Writer};
use tokio::sync::watch;

use super::{Daemon, Host, RunInfo, Shared, StopOrder, StopSink};
use crate::fleet::{Handle, Job};

/// Called once its commit is durable, or the ledger refused it.
pub type Done = Box<dyn FnOnce(Result<(), &StoreError>) + Send>;

/// What one step of the daemon leaves to be done, in order.
#[must_use = "the daemon's effects must be carried out (Shell::carry_out)"]
#[derive(Default)]
pub struct Effects(pub Vec<Effect>);

pub enum Effect {
    /// A batch to make durable, and what follows once it is.
    Commit(Box<Commit>),
    /// An answer that waits until everything before it is durable (a read).
    Answer(Done),
}

/// One commit: the batch, and what is done once it is durable.
pub struct Commit {
    pub batch: Batch,
    /// Stop orders, for the stopper (a crash before the commit must not leave the
    /// ledger saying granted while the processes are already killed).
    pub stops: Option<(StopSink, Vec<StopOrder>)>,
    /// F1: fleet-wide claims to end, once their endings are durable here, and the
    /// promotion evidence to share.
    pub fleet: Option<(Handle, FleetAfter)>,
    /// D5: entries readers may see once durable.
    pub journal: Vec<Arc<JournalEntry>>,
    /// Watchers of the touched runs, and what they are told.
    pub notes: Vec<(Arc<watch::Sender<RunInfo>>, RunInfo)>,
    /// It grants a run (the `grant-committed` failpoint).
    pub granted: bool,
    pub then: Done,
}

/// What a commit sends the fleet once durable: claims' endings, and what it shares.
pub type FleetAfter = (Vec<Job>, Vec<crate::fleet::SharedJob>);

/// The ledger writer and what a commit's aftermath reaches.
pub struct Shell {
    writer: Writer,
    shared: Arc<Shared>,
    fatal: Arc<crate::Fatal>,
}

impl Shell {
    pub fn new(writer: Writer, shared: Arc<Shared>, fatal: Arc<crate::Fatal>) -> Shell {
        Shell {
            writer,
            shared,
            fatal,
        }
    }

    /// Carries out a step's effects, in order.
    pub fn carry_out(&self, effects: Effects) {
        for e in effects.0 {
            match e {
                Effect::Commit(c) => self.commit(*c),
                Effect::Answer(done) => self.writer.submit(None, done),
            }
        }
    }

    fn commit(&self, c: Commit) {
        let Commit {
            batch,
            stops,
            fleet,
            journal,
            notes,
            granted,
            then,
        } = c;
        let (shared, fatal) = (self.shared.clone(), self.fatal.clone());
        self.writer.submit(Some(batch), move |res| {
            if let (Ok(()), Some((sink, stops))) = (&res, stops) {
                stops.into_iter().for_each(|o| sink(o));
            }
            if let (Ok(()), Some((link, (jobs, shared)))) = (&res, fleet) {
                jobs.into_iter().for_each(|j| link.send(j));
                shared.into_iter().for_each(|j| link.share(j));
            }
            if granted {
                crate::failpoint::hit("grant-committed");
            }
            if let Err(e) = &res {
                // D4: never go on after the ledger refused a write.
                fatal.raise(format!("the ledger refused a write: {e}"));
            } else {
                // D5: readers see an entry only once its change is durable.
                if !journal.is_empty() {
                    shared.journal.publish(journal);
                }
                for (tx, info) in notes {
                    let _ = tx.send(info);
                }
            }
            then(res);
        });
    }

    /// Transactions committed so far.
    pub fn commits(&self) -> u64 {
        self.writer.commits()
    }

    /// Waits until everything carried out so far is durable and answered.
    pub fn flush(&self) {
        let (tx, rx) = std::sync::mpsc::channel();
        self.writer.submit(None, move |_| {
            let _ = tx.send(());
        });
        let _ = rx.recv();
    }

    /// The daemon dies (the simulator's crash): what was carried out so far is durable,
    /// nothing more happens, and the daemon's own end (its clean-stop fence marker)
    /// never runs.
    #[cfg(test)]
    pub fn crash<H: Host>(self, daemon: Daemon<H>) {
        self.writer.close();
        drop(daemon);
    }

    /// Everything durable, the writer stopped, then the daemon's own end.
    pub fn close<H: Host>(self, daemon: Daemon<H>) {
        self.writer.close();
        daemon.close();
    }
}
