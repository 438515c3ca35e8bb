//! `check_invariants`: recomputes every derived figure from scratch and compares.
//! O(runs + keys); tests and the simulator call it after every step.

use crate::engine::{Engine, Run, DISK, MEMORY};
use crate::types::{KeyMode, Priority, RunState};

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

/// What the runs hold and wait for, recounted from the runs alone: the figures the
/// engine keeps incrementally are compared with it, family by family.
struct Recount {
    committed: Vec<u64>,
    pending: u64,
    pending_disk: u64,
    foreground_holding: u32,
    shared: Vec<u32>,
    exclusive: Vec<u32>,
    waiters: Vec<usize>,
    /// Per key, exclusive waiters by band.
    excl_waiting: Vec<[u32; 2]>,
    /// (fence, granted_at) of every run that has one.
    fences: Vec<(u64, u64)>,
    /// Per project: waiting, active, degraded.
    projects: Vec<[u32; 3]>,
    live: usize,
}

impl Engine {
    /// Every invariant, one family at a time: the run indexes and holdings (recount),
    /// A2 capacity, A4 keys, L1 fences, A11 positions, project counts and B1–B5.
    pub fn check_invariants(&self) -> Result<(), String> {
        // A5: no background run was ever granted while a foreground run waited.
        ensure!(
            self.background_grants_while_foreground_waits == 0,
            "{} background grant(s) while foreground runs waited",
            self.background_grants_while_foreground_waits
        );
        let rc = self.recount()?;
        self.check_capacity(&rc)?;
        self.check_keys(&rc)?;
        self.check_positions()?;
        self.check_projects(&rc)?;
        check_fences(rc.fences)?;
        self.check_budgets()
    }

    /// Each run's indexes follow its state, and what it holds or waits for is counted.
    fn recount(&self) -> Result<Recount, String> {
        let nkeys = self.keys.len();
        let mut rc = Recount {
            committed: vec![0; self.allocatable.len()],
            pending: 0,
            pending_disk: 0,
            foreground_holding: 0,
            shared: vec![0; nkeys],
            exclusive: vec![0; nkeys],
            waiters: vec![0; nkeys],
            excl_waiting: vec![[0; 2]; nkeys],
            fences: Vec::new(),
            projects: vec![[0; 3]; self.projects.len()],
            live: 0,
        };
        let mut in_queues = vec![None; self.runs.len()];
        for b in 0..2 {
            for (q, x) in self.queues[b].iter() {
                ensure!(in_queues[x as usize].is_none(), "slot {x} queued twice");
                in_queues[x as usize] = Some((b, q));
            }
        }
        for (slot, run) in self.runs.iter().enumerate() {
            let Some(run) = run else { continue };
            let s = slot as u32;
            self.check_run_indexes(s, run, in_queues[slot])?;
            rc.live += 1;
            if let Some(f) = run.fence {
                rc.fences.push((f, run.granted_at));
            }
            self.count_holdings(s, run, &mut rc)?;
            if !run.state.is_terminal() {
                let c = &mut rc.projects[run.project as usize];
                match run.state {
                    RunState::Queued => c[0] += 1,
                    RunState::Granted | RunState::Releasing => c[1] += 1,
                    RunState::Degraded => c[2] += 1,
                    _ => {}
                }
            }
        }
        ensure!(
            self.by_id.len() == rc.live,
            "id map has {} entries for {} runs",
            self.by_id.len(),
            rc.live
        );
        Ok(rc)
    }

    /// Exactly one state: membership in the id map and in the queue, deadline and
    /// expiry indexes follows the state and nothing else; a fence is A8-timed.
    fn check_run_indexes(
        &self,
        s: u32,
        run: &Run,
        queue: Option<(usize, u64)>,
    ) -> Result<(), String> {
        let id = &run.req.run_id;
        // With `by_id.len() == live`, this also proves ids are unique.
        ensure!(
            self.by_id.get(id) == Some(&s),
            "run {id} missing from the id map"
        );
        let queued = run.state == RunState::Queued;
        let in_queue = queue == Some((run.req.priority.index(), run.seq));
        ensure!(
            in_queue == queued,
            "run {id} ({:?}) queue membership {in_queue}",
            run.state
        );
        ensure!(
            self.deadlines.contains(&(run.deadline, s)) == queued,
            "run {id} ({:?}) deadline index wrong",
            run.state
        );
        let granted = run.state == RunState::Granted;
        ensure!(
            self.expiries.contains(&(run.expires_at, s)) == granted,
            "run {id} ({:?}) expiry index wrong",
            run.state
        );
        ensure!(
            queued == run.fence.is_none() || run.state.is_terminal(),
            "run {id} fence/state mismatch"
        );
        if let Some(f) = run.fence {
            ensure!(f <= self.last_fence, "run {id} fence {f} above the counter");
            // A8: no grant at or after the deadline.
            ensure!(
                run.granted_at < run.deadline
                    || (run.req.wait_ms == 0 && run.granted_at == run.enqueued_at),
                "run {id} granted at {} after its deadline {}",
                run.granted_at,
                run.deadline
            );
        }
        Ok(())
    }

    /// What `run` holds (resources, pending memory, keys) and the keys it waits on.
    fn count_holdings(&self, s: u32, run: &Run, rc: &mut Recount) -> Result<(), String> {
        let id = &run.req.run_id;
        if run.state.holds_claim() {
            for (c, a) in rc.committed.iter_mut().zip(run.amounts.iter()) {
                *c += a;
            }
            if run.pending_mem {
                rc.pending += run.amounts[MEMORY];
                rc.pending_disk += run.amounts[DISK];
            }
            if run.req.priority == Priority::Foreground {
                rc.foreground_holding += 1;
            }
            for &(k, mode) in &run.keys {
                if run.upgrade == Some(k) {
                    ensure!(
                        self.key(k).upgrades.contains(&s),
                        "run {id} upgrade missing from its key"
                    );
                    continue;
                }
                match mode {
                    KeyMode::Exclusive => rc.exclusive[k as usize] += 1,
                    KeyMode::Shared => rc.shared[k as usize] += 1,
                }
                ensure!(
                    mode != KeyMode::Exclusive || self.key(k).exclusive == Some(s),
                    "run {id} exclusive hold not recorded"
                );
            }
        } else {
            ensure!(
                !run.pending_mem && run.upgrade.is_none(),
                "run {id} holds nothing but has pending parts"
            );
        }
        if run.state == RunState::Queued {
            for &(k, mode) in &run.keys {
                ensure!(
                    self.key(k)
                        .waiters
                        .contains(&(run.req.priority, run.seq, s)),
                    "queued run {id} missing from key {}",
                    self.key(k).name
                );
                rc.waiters[k as usize] += 1;
                if mode == KeyMode::Exclusive {
                    rc.excl_waiting[k as usize][run.req.priority.index()] += 1;
                }
            }
        }
        Ok(())
    }

    /// A2: nothing over-committed, and the running sums agree with the recount.
    fn check_capacity(&self, rc: &Recount) -> Result<(), String> {
        for (i, &held) in rc.committed.iter().enumerate() {
            let name = &self.res_names[i];
            ensure!(
                held == self.committed[i],
                "{name} committed {} but runs hold {held}",
                self.committed[i]
            );
            ensure!(
                held <= self.allocatable[i],
                "{name} over-committed: {held} > {}",
                self.allocatable[i]
            );
        }
        ensure!(
            rc.pending == self.pending_memory,
            "pending memory {} but runs hold {}",
            self.pending_memory,
            rc.pending
        );
        ensure!(
            rc.pending_disk == self.pending_disk,
            "pending disk {} but runs hold {}",
            self.pending_disk,
            rc.pending_disk
        );
        ensure!(
            rc.foreground_holding == self.foreground_holding,
            "{} foreground runs counted holding but {} do",
            self.foreground_holding,
            rc.foreground_holding
        );
        Ok(())
    }

    /// A4: exclusive means alone; the counters match the holders and waiters.
    fn check_keys(&self, rc: &Recount) -> Result<(), String> {
        for (k, key) in self.keys.iter().enumerate() {
            let Some(key) = key else { continue };
            let (sh, ex, name) = (rc.shared[k], rc.exclusive[k], &key.name);
            ensure!(
                key.shared == sh,
                "key {name} shared count {} but {sh} holders",
                key.shared
            );
            ensure!(
                ex <= 1 && (ex == 1) == key.exclusive.is_some(),
                "key {name} has {ex} exclusive holders"
            );
            ensure!(
                !(ex == 1 && sh > 0),
                "key {name} held exclusive and shared at once"
            );
            ensure!(
                key.waiters.len() == rc.waiters[k],
                "key {name} waiter set is stale"
            );
            for (band, &want) in rc.excl_waiting[k].iter().enumerate() {
                ensure!(
                    key.exclusive_waiting[band] == want,
                    "key {name} exclusive waiting {} != {want}",
                    key.exclusive_waiting[band]
                );
            }
            for &u in &key.upgrades {
                let r = self.run(u);
                ensure!(
                    r.upgrade == Some(k as u32) && r.state.holds_claim(),
                    "key {name} upgrade entry stale"
                );
            }
        }
        Ok(())
    }

    /// A11: positions are consistent with queue order; background after foreground.
    fn check_positions(&self) -> Result<(), String> {
        let fg = self.queues[0].len() as u64;
        for band in 0..2 {
            for (i, (seq, s)) in self.queues[band].iter().enumerate() {
                let r = self.run(s);
                let id = &r.req.run_id;
                ensure!(r.seq == seq, "queue entry seq mismatch for {id}");
                ensure!(r.req.priority.index() == band, "run {id} in the wrong band");
                let expect = i as u64 + 1 + if band == 1 { fg } else { 0 };
                let at = self.position(s);
                ensure!(at == expect, "run {id} position {at} != {expect}");
            }
        }
        Ok(())
    }

    /// Each project's waiting, active and degraded counts match its runs.
    fn check_projects(&self, rc: &Recount) -> Result<(), String> {
        for (p, st) in self.projects.iter().enumerate() {
            let Some(st) = st else { continue };
            let (have, want) = ([st.waiting, st.active, st.degraded], rc.projects[p]);
            ensure!(
                have == want,
                "project {} counts {have:?} != {want:?}",
                st.name
            );
        }
        Ok(())
    }

    /// B1–B5: the scopes' own rules hold (no harness over its limit, counts match the
    /// tokens), every run holding a claim with a budget holds its token, and every
    /// waiter's scope is frozen and not stopped.
    fn check_budgets(&self) -> Result<(), String> {
        self.scopes.check_invariants()?;
        let mut users: std::collections::BTreeMap<&str, u32> = Default::default();
        for run in self.runs.iter().flatten() {
            let Some(b) = run.req.budget.as_deref() else {
                continue;
            };
            // An ended run's scope may be forgotten since (S10).
            if run.state.is_terminal() {
                continue;
            }
            *users.entry(b.scope.as_str()).or_insert(0) += 1;
            let id = &run.req.run_id;
            let scope = self.scopes.get(&b.scope);
            ensure!(scope.is_some(), "run {id}: scope {} is not frozen", b.scope);
            if run.state.holds_claim() {
                let t = self.scopes.token(&b.scope, id, b.operation());
                ensure!(
                    t.is_some_and(|t| t.harness == b.harness && t.run_id.as_deref() == Some(id)),
                    "run {id} holds its claim without its {} token",
                    b.harness
                );
            }
            if run.state == RunState::Queued {
                ensure!(
                    scope.is_some_and(|s| s.control != crate::scopes::Control::Stopped),
                    "run {id} waits in stopped scope {}",
                    b.scope
                );
            }
        }
        for s in self.scopes.iter() {
            let n = users.get(s.id.as_str()).copied().unwrap_or(0);
            ensure!(
                s.users == n,
                "scope {}: {} users counted, {n} runs not yet ended name it",
                s.id,
                s.users
            );
        }
        Ok(())
    }
}

/// L1: fences are unique and strictly increase in grant order.
fn check_fences(mut fences: Vec<(u64, u64)>) -> Result<(), String> {
    fences.sort_unstable();
    for w in fences.windows(2) {
        ensure!(w[0].0 != w[1].0, "fence {} issued twice", w[0].0);
        ensure!(
            w[0].1 <= w[1].1,
            "fence {} was granted after fence {}",
            w[0].0,
            w[1].0
        );
    }
    Ok(())
}
