//! `check_invariants`: recomputes every derived figure from scratch and compares.
//! O(runs + keys); tests and the simulator call it after every step.

use crate::engine::{Engine, MEMORY};
use crate::types::{KeyMode, RunState};

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

impl Engine {
    pub fn check_invariants(&self) -> Result<(), String> {
        // A5: no background run was ever granted while a foreground run waited.
        ensure!(
            self.background_grants_while_foreground_waits == 0,
            "{} background grant(s) while foreground runs waited",
            self.background_grants_while_foreground_waits
        );
        let n = self.allocatable.len();
        let nkeys = self.keys.len();
        let mut committed = vec![0u64; n];
        let mut pending = 0u64;
        let mut shared = vec![0u32; nkeys];
        let mut exclusive = vec![0u32; nkeys];
        let mut waiters = vec![0usize; nkeys];
        let mut excl_waiting = vec![[0u32; 2]; nkeys];
        let mut fences: Vec<(u64, u64)> = Vec::new();
        let mut project_counts = vec![[0u32; 3]; self.projects.len()];
        let mut live = 0usize;
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
            let id = &run.req.run_id;
            // With `by_id.len() == live` below, this also proves ids are unique.
            ensure!(
                self.by_id.get(id) == Some(&s),
                "run {id} missing from the id map"
            );
            live += 1;
            let queued = run.state == RunState::Queued;
            let band = run.req.priority.index();
            // Exactly one state: membership in the queue, deadline and expiry indexes
            // follows the state and nothing else.
            let in_queue = in_queues[slot] == Some((band, run.seq));
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
                fences.push((f, run.granted_at));
                // A8: no grant at or after the deadline.
                ensure!(
                    run.granted_at < run.deadline
                        || (run.req.wait_ms == 0 && run.granted_at == run.enqueued_at),
                    "run {id} granted at {} after its deadline {}",
                    run.granted_at,
                    run.deadline
                );
            }
            if run.state.holds_claim() {
                for (c, a) in committed.iter_mut().zip(run.amounts.iter()) {
                    *c += a;
                }
                if run.pending_mem {
                    pending += run.amounts[MEMORY];
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
                        KeyMode::Exclusive => exclusive[k as usize] += 1,
                        KeyMode::Shared => shared[k as usize] += 1,
                    }
                    if mode == KeyMode::Exclusive {
                        ensure!(
                            self.key(k).exclusive == Some(s),
                            "run {id} exclusive hold not recorded"
                        );
                    }
                }
            } else {
                ensure!(
                    !run.pending_mem && run.upgrade.is_none(),
                    "run {id} holds nothing but has pending parts"
                );
            }
            if queued {
                for &(k, mode) in &run.keys {
                    ensure!(
                        self.key(k)
                            .waiters
                            .contains(&(run.req.priority, run.seq, s)),
                        "queued run {id} missing from key {}",
                        self.key(k).name
                    );
                    waiters[k as usize] += 1;
                    if mode == KeyMode::Exclusive {
                        excl_waiting[k as usize][band] += 1;
                    }
                }
            }
            if !run.state.is_terminal() {
                let c = &mut project_counts[run.project as usize];
                match run.state {
                    RunState::Queued => c[0] += 1,
                    RunState::Granted | RunState::Releasing => c[1] += 1,
                    RunState::Degraded => c[2] += 1,
                    _ => {}
                }
            }
        }
        ensure!(
            self.by_id.len() == live,
            "id map has {} entries for {live} runs",
            self.by_id.len()
        );

        // A2: nothing over-committed, and the running sums agree with the recount.
        for (i, &held) in committed.iter().enumerate().take(n) {
            ensure!(
                held == self.committed[i],
                "{} committed {} but runs hold {}",
                self.res_names[i],
                self.committed[i],
                held
            );
            ensure!(
                held <= self.allocatable[i],
                "{} over-committed: {} > {}",
                self.res_names[i],
                held,
                self.allocatable[i]
            );
        }
        ensure!(
            pending == self.pending_memory,
            "pending memory {} but runs hold {pending}",
            self.pending_memory
        );

        // A4: exclusive means alone; the counters match the holders and waiters.
        for (k, key) in self.keys.iter().enumerate() {
            let Some(key) = key else { continue };
            let k = k as u32;
            let sh = shared[k as usize];
            let ex = exclusive[k as usize];
            ensure!(
                key.shared == sh,
                "key {} shared count {} but {sh} holders",
                key.name,
                key.shared
            );
            ensure!(
                ex <= 1 && (ex == 1) == key.exclusive.is_some(),
                "key {} has {ex} exclusive holders",
                key.name
            );
            ensure!(
                !(ex == 1 && sh > 0),
                "key {} held exclusive and shared at once",
                key.name
            );
            ensure!(
                key.waiters.len() == waiters[k as usize],
                "key {} waiter set is stale",
                key.name
            );
            for (band, &want) in excl_waiting[k as usize].iter().enumerate() {
                ensure!(
                    key.exclusive_waiting[band] == want,
                    "key {} exclusive waiting {} != {want}",
                    key.name,
                    key.exclusive_waiting[band]
                );
            }
            for &u in &key.upgrades {
                let r = self.run(u);
                ensure!(
                    r.upgrade == Some(k) && r.state.holds_claim(),
                    "key {} upgrade entry stale",
                    key.name
                );
            }
        }

        // L1: fences are unique and strictly increase in grant order.
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

        // A11: positions are consistent with queue order; background after foreground.
        let fg = self.queues[0].len() as u64;
        for band in 0..2 {
            for (i, (seq, s)) in self.queues[band].iter().enumerate() {
                let r = self.run(s);
                ensure!(
                    r.seq == seq,
                    "queue entry seq mismatch for {}",
                    r.req.run_id
                );
                ensure!(
                    r.req.priority.index() == band,
                    "run {} in the wrong band",
                    r.req.run_id
                );
                let expect = i as u64 + 1 + if band == 1 { fg } else { 0 };
                ensure!(
                    self.position(s) == expect,
                    "run {} position {} != {expect}",
                    r.req.run_id,
                    self.position(s)
                );
            }
        }

        for (p, st) in self.projects.iter().enumerate() {
            let Some(st) = st else { continue };
            let want = project_counts[p];
            ensure!(
                [st.waiting, st.active, st.degraded] == want,
                "project {} counts {:?} != {want:?}",
                st.name,
                [st.waiting, st.active, st.degraded]
            );
        }
        self.check_budgets()?;
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
