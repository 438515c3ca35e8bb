//! What the daemon keeps about a run besides the engine's view of it.

use std::collections::BTreeMap;

use berth_store::{ProcessRecord, RunRecord, WorkspaceIdentity};

pub(super) struct Extra {
    pub(super) worktree: Option<String>,
    pub(super) labels: BTreeMap<String, String>,
    pub(super) queue_seq: u64,
    pub(super) workspace: Option<WorkspaceIdentity>,
    pub(super) processes: Vec<ProcessRecord>,
    /// Pids that survived SIGKILL in the last stop (the run is degraded).
    pub(super) survivors: Vec<i32>,
    /// The run's own grace between SIGTERM and SIGKILL (P2), if it asked for one.
    pub(super) stop_grace_ms: Option<u64>,
    /// Why berth ended the run at its grant (not kept in the ledger).
    pub(super) failure: Option<String>,
    /// The ports its contract declares, by name, with the number held (0 until it is
    /// granted) (W3).
    pub(super) ports: Vec<(String, u16)>,
    /// Set once the run has ended and its record is durable: the digest of
    /// (worktree, labels, stop grace), kept for the idempotent re-acquire check (L7)
    /// instead of the values themselves (see `shrink`).
    ended_digest: Option<[u8; 32]>,
    /// A detached waiter: it keeps its place without a connection (A9 does not apply),
    /// and a restart gives it no reconnect window. Once set, never cleared.
    pub(super) detached: bool,
    /// G0: the agent thread the run works in.
    pub(super) thread: Option<String>,
    /// A lease only: no workspace is made at its grant (`"workspace": false`).
    pub(super) lease_only: bool,
    /// S9: the uid of the uid-bound token that made the run (kept when it shrinks).
    pub(super) owner_uid: Option<u32>,
    /// The run's first journal entry (0: none yet): retention keeps the journal from
    /// the oldest live run's on (issue 32 finding 8).
    pub(super) journal_first: u64,
    /// C6: an analysis run's grant-time view of the host's listeners: only these may
    /// be in its baseline (a listener opened between the grant and a registration is
    /// the run's own). `None` after a restart (the baseline is then what it holds).
    /// (Sorted; a boxed slice: every remembered run carries the field.)
    pub(super) listeners_at_grant: Option<Box<[u64]>>,
    /// Issue 36: berth made the run a cgroup (a process registered or launched): its
    /// use is read from it while it holds its claim.
    pub(super) grouped: bool,
    /// Issue 36: what its cgroup had used when its stop ended (boxed: most runs have
    /// none, and every remembered run carries the field).
    pub(super) usage: Option<Box<berth_proc::limits::Usage>>,
}

/// What an acquire carries besides the engine's request, as one digest.
fn extras_digest(
    worktree: &Option<String>,
    labels: &BTreeMap<String, String>,
    stop_grace_ms: Option<u64>,
) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let text = serde_json::to_vec(&(worktree, labels, stop_grace_ms)).unwrap_or_default();
    Sha256::digest(&text).into()
}

impl Extra {
    /// A new run's extras, as its acquire gave them.
    pub(super) fn new(
        worktree: Option<String>,
        labels: BTreeMap<String, String>,
        stop_grace_ms: Option<u64>,
        queue_seq: u64,
    ) -> Extra {
        Extra {
            ports: Vec::new(),
            worktree,
            labels,
            queue_seq,
            workspace: None,
            processes: Vec::new(),
            survivors: Vec::new(),
            stop_grace_ms,
            failure: None,
            ended_digest: None,
            detached: false,
            thread: None,
            lease_only: false,
            owner_uid: None,
            journal_first: 0,
            listeners_at_grant: None,
            grouped: false,
            usage: None,
        }
    }

    /// A run's extras as its ledger record gives them back.
    pub(super) fn restored(r: &mut RunRecord) -> Extra {
        let mut extra = Extra::new(
            r.worktree.take(),
            std::mem::take(&mut r.labels),
            r.stop_grace_ms,
            r.queue_seq,
        );
        extra.workspace = r.workspace.take();
        extra.processes = std::mem::take(&mut r.processes);
        // A restarted daemon re-adopts a run's registered processes in its group.
        extra.grouped = !extra.processes.is_empty();
        extra.ports = std::mem::take(&mut r.ports);
        extra.detached = r.detached;
        extra.thread = r.thread.take();
        extra.lease_only = r.lease_only;
        extra.owner_uid = r.owner_uid;
        extra.journal_first = r.journal_first;
        if r.state.is_terminal() {
            extra.shrink();
        }
        extra
    }

    /// An ended run keeps only what answering about it needs: up to `ended_retained_max` (10,000 by default) of them are
    /// remembered, and a run's labels (up to 32 × 320 bytes), worktree path and process
    /// list would make that a gigabyte (68,000 ended runs with large labels once took
    /// 1 GB). The ledger keeps them all; `GET` of an ended run shows none of them.
    pub(super) fn shrink(&mut self) {
        self.workspace = None;
        self.processes = Vec::new();
        self.ports = Vec::new();
        self.survivors = Vec::new();
        self.listeners_at_grant = None;
        // Nothing to free without labels or a worktree: no digest (hashing every
        // ended run cost the daemon time on the request path).
        if self.ended_digest.is_some() || (self.labels.is_empty() && self.worktree.is_none()) {
            return;
        }
        self.ended_digest = Some(extras_digest(
            &self.worktree,
            &self.labels,
            self.stop_grace_ms,
        ));
        self.labels = BTreeMap::new();
        self.worktree = None;
    }

    /// Would an acquire with these extras be a different request (L7)?
    pub(super) fn differs(
        &self,
        worktree: &Option<String>,
        labels: &BTreeMap<String, String>,
        stop_grace_ms: Option<u64>,
    ) -> bool {
        match self.ended_digest {
            Some(d) => d != extras_digest(worktree, labels, stop_grace_ms),
            None => {
                self.worktree != *worktree
                    || self.labels != *labels
                    || self.stop_grace_ms != stop_grace_ms
            }
        }
    }
}

pub(super) fn proc_id(p: &ProcessRecord) -> berth_proc::ProcId {
    berth_proc::ProcId {
        pid: p.pid,
        start_ticks: p.start_ticks,
        boot_id: p.boot_id.clone(),
    }
}
