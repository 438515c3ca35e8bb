//! `check_invariants`: recomputes every derived figure from scratch and compares.
//! O(runs + keys); tests and the simulator call it after every step.

use std::collections::{BTreeMap, HashMap, HashSet};

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
        let n = self.allocatable.len();
        let mut committed = vec![0u64; n];
        let mut pending = 0u64;
        let mut shared: HashMap<u32, u32> = HashMap::new();
        let mut exclusive: HashMap<u32, u32> = HashMap::new();
        let mut waiters: HashMap<u32, usize> = HashMap::new();
        let mut excl_waiting: HashMap<(u32, usize), u32> = HashMap::new();
        let mut fences: BTreeMap<u64, u64> = BTreeMap::new();
        let mut project_counts: HashMap<u32, [u32; 3]> = HashMap::new();
        let mut live_ids = HashSet::new();
        let in_queues: HashSet<(usize, u64, u32)> = (0..2)
            .flat_map(|b| self.queues[b].iter().map(move |(q, x)| (b, q, x)))
            .collect();

        for (slot, run) in self.runs.iter().enumerate() {
            let Some(run) = run else { continue };
            let s = slot as u32;
            let id = &run.req.run_id;
            ensure!(self.by_id.get(id) == Some(&s), "run {id} missing from the id map");
            ensure!(live_ids.insert(id.clone()), "run id {id} appears twice");
            let queued = run.state == RunState::Queued;
            let band = run.req.priority.index();
            // Exactly one state: membership in the queue, deadline and expiry indexes
            // follows the state and nothing else.
            let in_queue = in_queues.contains(&(band, run.seq, s));
            ensure!(in_queue == queued, "run {id} ({:?}) queue membership {in_queue}", run.state);
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
            ensure!(queued == run.fence.is_none() || run.state.is_terminal(), "run {id} fence/state mismatch");
            if let Some(f) = run.fence {
                ensure!(f <= self.last_fence, "run {id} fence {f} above the counter");
                ensure!(fences.insert(f, run.granted_at).is_none(), "fence {f} issued twice");
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
                        KeyMode::Exclusive => *exclusive.entry(k).or_default() += 1,
                        KeyMode::Shared => *shared.entry(k).or_default() += 1,
                    }
                    if mode == KeyMode::Exclusive {
                        ensure!(self.key(k).exclusive == Some(s), "run {id} exclusive hold not recorded");
                    }
                }
            } else {
                ensure!(!run.pending_mem && run.upgrade.is_none(), "run {id} holds nothing but has pending parts");
            }
            if queued {
                for &(k, mode) in &run.keys {
                    ensure!(
                        self.key(k).waiters.contains(&(run.req.priority, run.seq, s)),
                        "queued run {id} missing from key {}",
                        self.key(k).name
                    );
                    *waiters.entry(k).or_default() += 1;
                    if mode == KeyMode::Exclusive {
                        *excl_waiting.entry((k, band)).or_default() += 1;
                    }
                }
            }
            if !run.state.is_terminal() {
                let c = project_counts.entry(run.project).or_default();
                match run.state {
                    RunState::Queued => c[0] += 1,
                    RunState::Granted | RunState::Releasing => c[1] += 1,
                    RunState::Degraded => c[2] += 1,
                    _ => {}
                }
            }
        }
        ensure!(self.by_id.len() == live_ids.len(), "id map has {} entries for {} runs", self.by_id.len(), live_ids.len());

        // A2: nothing over-committed, and the running sums agree with the recount.
        for i in 0..n {
            ensure!(committed[i] == self.committed[i], "{} committed {} but runs hold {}", self.res_names[i], self.committed[i], committed[i]);
            ensure!(committed[i] <= self.allocatable[i], "{} over-committed: {} > {}", self.res_names[i], committed[i], self.allocatable[i]);
        }
        ensure!(pending == self.pending_memory, "pending memory {} but runs hold {pending}", self.pending_memory);

        // A4: exclusive means alone; the counters match the holders and waiters.
        for (k, key) in self.keys.iter().enumerate() {
            let Some(key) = key else { continue };
            let k = k as u32;
            let sh = shared.get(&k).copied().unwrap_or(0);
            let ex = exclusive.get(&k).copied().unwrap_or(0);
            ensure!(key.shared == sh, "key {} shared count {} but {sh} holders", key.name, key.shared);
            ensure!(ex <= 1 && (ex == 1) == key.exclusive.is_some(), "key {} has {ex} exclusive holders", key.name);
            ensure!(!(ex == 1 && sh > 0), "key {} held exclusive and shared at once", key.name);
            ensure!(key.waiters.len() == waiters.get(&k).copied().unwrap_or(0), "key {} waiter set is stale", key.name);
            for band in 0..2 {
                let want = excl_waiting.get(&(k, band)).copied().unwrap_or(0);
                ensure!(key.exclusive_waiting[band] == want, "key {} exclusive waiting {} != {want}", key.name, key.exclusive_waiting[band]);
            }
            for &u in &key.upgrades {
                let r = self.run(u);
                ensure!(r.upgrade == Some(k) && r.state.holds_claim(), "key {} upgrade entry stale", key.name);
            }
        }

        // L1: fences strictly increase in grant order.
        let mut last_at = 0;
        for (_, &at) in &fences {
            ensure!(at >= last_at, "a later fence was granted earlier");
            last_at = at;
        }

        // A11: positions are consistent with queue order; background after foreground.
        let fg = self.queues[0].len() as u64;
        for band in 0..2 {
            for (i, (seq, s)) in self.queues[band].iter().enumerate() {
                let r = self.run(s);
                ensure!(r.seq == seq, "queue entry seq mismatch for {}", r.req.run_id);
                ensure!(r.req.priority.index() == band, "run {} in the wrong band", r.req.run_id);
                let expect = i as u64 + 1 + if band == 1 { fg } else { 0 };
                ensure!(self.position(s) == expect, "run {} position {} != {expect}", r.req.run_id, self.position(s));
            }
        }

        for (p, st) in self.projects.iter().enumerate() {
            let Some(st) = st else { continue };
            let want = project_counts.get(&(p as u32)).copied().unwrap_or([0; 3]);
            ensure!([st.waiting, st.active, st.degraded] == want, "project {} counts {:?} != {want:?}", st.name, [st.waiting, st.active, st.degraded]);
        }
        Ok(())
    }
}
