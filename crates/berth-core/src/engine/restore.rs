//! Restore (D2): an engine rebuilt from the ledger's runs, scopes and evidence. After
//! it, `apply` is the only mutator.

use super::*;

impl Engine {
    /// Rebuilds an engine from what the ledger remembers (P5): `runs` in arrival order,
    /// with times already on this process's monotonic clock. Live runs get their claims
    /// back in the recorded key modes; queued runs keep their order. Refuses a ledger
    /// whose runs contradict each other (D4) instead of guessing.
    pub fn restore(
        cfg: Config,
        last_fence: Fence,
        now: TimeMs,
        runs: Vec<RestoredRun>,
    ) -> Result<Engine, String> {
        Engine::restore_with_scopes(cfg, last_fence, now, runs, Vec::new(), Vec::new(), false)
    }

    /// [`Engine::restore`] with the experiment scopes the ledger kept (B1–B5): a live
    /// run's budget token must be among them, and a waiter's scope too; with each
    /// project's promotion evidence (C3); and with the drain in force or not (G4).
    /// Restoring is building an engine: after it, `apply` is the only way its state
    /// changes. (The drain was once restored by applying `Command::Drain` and dropping
    /// its events: that apply also expired the leases and waiters overdue at the
    /// restart, unjournaled, unrecorded and unstopped.)
    pub fn restore_with_scopes(
        cfg: Config,
        last_fence: Fence,
        now: TimeMs,
        runs: Vec<RestoredRun>,
        scopes: Vec<Scope>,
        evidence: Vec<(String, Evidence)>,
        draining: bool,
    ) -> Result<Engine, String> {
        let mut e = Engine::new(cfg, last_fence)?;
        e.now = now;
        e.draining = draining;
        for mut s in scopes {
            // The idle window starts again: the ledger does not keep when it began.
            s.touched_ms = now;
            e.scopes.restore(s);
        }
        for r in runs {
            e.restore_one(r)?;
        }
        for (project, ev) in evidence {
            let p = e.intern_project(&project);
            e.project_mut(p).evidence = Some(ev);
        }
        e.check_invariants()
            .map_err(|m| format!("restored ledger is inconsistent: {m}"))?;
        Ok(e)
    }

    /// Memory and disk granted recently are still pending (A2, issue 36), across a
    /// restart too (a settle seen before it is not kept: it counts from the grant).
    fn restore_pending(&mut self, r: &RestoredRun, slot: Slot, amounts: &[u64]) -> bool {
        let settle = r.granted_at.saturating_add(self.cfg.pending_settle_ms);
        let pending = r.state.holds_claim()
            && (amounts[MEMORY] > 0 || amounts[DISK] > 0)
            && settle > self.now;
        if pending {
            self.pending_memory += amounts[MEMORY];
            self.pending_disk += amounts[DISK];
            self.pending.push_back((settle, slot, r.fence.unwrap_or(0)));
        }
        pending
    }

    pub(super) fn restore_one(&mut self, r: RestoredRun) -> Result<(), String> {
        let id = r.request.run_id.clone();
        if self.by_id.contains_key(&id) {
            return Err(format!("run {id} appears twice"));
        }
        if r.fence.is_some_and(|f| f > self.last_fence) {
            return Err(format!("run {id} has a fence above the counter"));
        }
        let p = self.intern_project(&r.request.project);
        let amounts = self.amounts_of(&r.request.resources);
        let keys = self.intern_keys(&r.request, r.primary_mode);
        let slot = self.alloc_slot();
        let live = !r.state.is_terminal();
        if let Some(b) = r.request.budget.as_deref().filter(|_| live) {
            self.scopes.count_user(&b.scope, true, self.now);
        }
        let seq = if r.state == RunState::Queued {
            let seq = self.queues[r.request.priority.index()].push(slot);
            self.wait_on_keys(slot, seq, r.request.priority, &keys);
            self.deadlines.insert((r.deadline, slot));
            seq
        } else {
            0
        };
        if r.state.holds_claim() {
            self.restore_holdings(&r, slot, &amounts, &keys)?;
        }
        let pending = self.restore_pending(&r, slot, &amounts);
        let upgrade = (r.upgrading && r.state.holds_claim()).then(|| keys[0].0);
        let promoted_shared =
            r.request.class == Class::Managed && r.primary_mode == KeyMode::Shared;
        self.runs[slot as usize] = Some(Box::new(Run {
            contract: r.request.contract.clone(),
            req: r.request,
            project: p,
            amounts,
            keys,
            promoted_shared,
            state: RunState::Queued,
            seq,
            enqueued_at: r.enqueued_at,
            deadline: r.deadline,
            fence: r.fence,
            granted_at: r.granted_at,
            expires_at: r.expires_at,
            cause: r.cause,
            upgrade,
            pending_mem: pending,
            permit: None,
            permit_asked: false,
            last_reason: None,
        }));
        self.by_id.insert(id, slot);
        self.project_mut(p).waiting += 1;
        if r.state != RunState::Queued {
            self.set_state(slot, r.state);
            if !live {
                // Terminal: remembered for `410 gone` and idempotent re-acquire.
                self.ended.push_back(slot);
                self.gc_project(p);
            }
        }
        Ok(())
    }

    /// A restored run that holds its claim takes it again: its resources (never over
    /// the allocatable), its keys (a conflict means the ledger is inconsistent), its
    /// place in an upgrade queue (C4) and its expiry.
    pub(super) fn restore_holdings(
        &mut self,
        r: &RestoredRun,
        slot: Slot,
        amounts: &[u64],
        keys: &[(KeyId, KeyMode)],
    ) -> Result<(), String> {
        let id = &r.request.run_id;
        for (i, a) in amounts.iter().enumerate() {
            self.committed[i] = self.committed[i].saturating_add(*a);
            if self.committed[i] > self.allocatable[i] {
                return Err(format!("restored claims over-commit {}", self.res_names[i]));
            }
        }
        for (i, &(k, mode)) in keys.iter().enumerate() {
            if i == 0 && r.upgrading {
                // C4: back in the upgrade queue, holding nothing on the key.
                if mode != KeyMode::Exclusive || r.request.class != Class::Managed {
                    return Err(format!(
                        "run {id} upgrades a key it does not claim exclusively"
                    ));
                }
                self.key_mut(k).upgrades.push_back(slot);
                self.keys_with_upgrades.insert(k);
                continue;
            }
            let ks = self.key_mut(k);
            match mode {
                KeyMode::Exclusive if ks.exclusive.is_none() && ks.shared == 0 => {
                    ks.exclusive = Some(slot)
                }
                KeyMode::Shared if ks.exclusive.is_none() => ks.shared += 1,
                _ => return Err(format!("run {id} conflicts on key {}", ks.name)),
            }
        }
        if r.state == RunState::Granted {
            self.expiries.insert((r.expires_at, slot));
        }
        Ok(())
    }
}
