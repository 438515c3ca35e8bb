//! The pass (A5–A11): who is granted, in order, what blocks the head, the backfill
//! window's guard, key upgrades, and `grant` itself.

use super::*;

impl Engine {
    /// Why `s` cannot be granted right now, ignoring the starvation guard.
    /// `is_head`: the head of its band is exempt from writer preference (A4), otherwise
    /// it and a later exclusive waiter would wait for each other under the guard (A7).
    pub(crate) fn blocker(&self, s: Slot, is_head: bool) -> Option<Blocker> {
        if self.draining {
            return Some(Blocker::Draining);
        }
        let run = self.run(s);
        if let Some(b) = self.pressure_blocker(run.req.priority) {
            return Some(b);
        }
        if run.req.priority == Priority::Background && !self.queues[0].is_empty() {
            return Some(Blocker::ForegroundWaiting);
        }
        if let Some(b) = &run.req.budget {
            let owner = &run.req.run_id;
            if let Some(block) = self
                .scopes
                .blocked(&b.scope, &b.harness, owner, b.operation())
            {
                return Some(Blocker::Budget(s, block));
            }
        }
        for &(k, mode) in &run.keys {
            let ks = self.key(k);
            if !ks.upgrades.is_empty() {
                return Some(Blocker::Upgrade(k));
            }
            if let Some(h) = ks.exclusive {
                return Some(Blocker::ExclusiveHeld(k, h));
            }
            match mode {
                KeyMode::Exclusive if ks.shared > 0 => {
                    return Some(Blocker::SharedHeld(k, ks.shared))
                }
                KeyMode::Shared if !is_head && self.writer_waiting(ks, run.req.priority) => {
                    return Some(Blocker::WriterWaiting(k))
                }
                _ => {}
            }
        }
        for (res, ((&c, &a), &need)) in self
            .committed
            .iter()
            .zip(&self.allocatable)
            .zip(run.amounts.iter())
            .enumerate()
        {
            // S7: checked, so no request can wrap the sum under the limit.
            if c.checked_add(need).is_none_or(|sum| sum > a) {
                return Some(Blocker::Resource {
                    res,
                    need,
                    free: a - c,
                });
            }
        }
        if let Some(b) = self.live_blocker(run) {
            return Some(b);
        }
        // Last: the fleet is asked only for a run that would otherwise be granted, so a
        // fleet-wide token is not held while the run waits for local capacity. A permit
        // whose fence is not above the host's last is stale (another run's permit, taken
        // later, was granted first): granting it would break L1's order.
        if self.cfg.fleet && run.permit.is_none_or(|f| f <= self.last_fence) {
            return Some(Blocker::Permit);
        }
        None
    }

    /// A2 and issue 36: the run's memory and disk must also fit what the host has now
    /// (sampled MemAvailable and free disk, less reserves and pending claims).
    fn live_blocker(&self, run: &Run) -> Option<Blocker> {
        let (need, free) = (run.amounts[MEMORY], self.ambient_free());
        if need > free {
            return Some(Blocker::Ambient { need, free });
        }
        let (need, free) = (run.amounts[DISK], self.disk_ambient_free());
        (need > free).then_some(Blocker::Disk { need, free })
    }

    /// Issue 36: a host reclaiming (or stalling on cpu or io) to keep up takes no one
    /// new; background runs are held back first (at the lower figure: memory's own,
    /// half of cpu's and io's).
    fn pressure_blocker(&self, priority: Priority) -> Option<Blocker> {
        let c = &self.cfg;
        PressureKind::ALL.into_iter().find_map(|kind| {
            let fg = match kind {
                PressureKind::Memory => c.pressure_foreground_max_bp,
                PressureKind::Cpu => c.pressure_cpu_max_bp,
                PressureKind::Io => c.pressure_io_max_bp,
            };
            let max = match (priority, kind) {
                (Priority::Foreground, _) => fg,
                (Priority::Background, PressureKind::Memory) => c.pressure_background_max_bp,
                (Priority::Background, _) => fg / 2,
            };
            let bp = self.pressure_bp[kind.index()];
            (bp > max).then_some(Blocker::Pressure { kind, bp, max })
        })
    }

    /// Memory that the host really has for new grants (A2): stabilised MemAvailable less
    /// the reserve (issue 36: the idle reserve while no foreground run holds a claim),
    /// less memory granted whose processes have not started using it.
    pub(crate) fn ambient_free(&self) -> u64 {
        match self.stabilized_available {
            Some(avail) => avail
                .saturating_sub(self.live_memory_reserve())
                .saturating_sub(self.pending_memory),
            None => u64::MAX,
        }
    }

    /// The reserve the live memory check keeps back now (issue 36).
    pub(crate) fn live_memory_reserve(&self) -> u64 {
        match (self.foreground_holding, self.cfg.memory_reserve_idle) {
            (0, Some(idle)) => idle,
            _ => self.cfg.memory_reserve,
        }
    }

    /// Issue 36: disk the host really has for new grants: the sampled free space less
    /// the disk reserve, less the disk claims of grants still pending (their runs have
    /// not written yet, so the free space does not show them).
    pub(crate) fn disk_ambient_free(&self) -> u64 {
        match self.disk_free {
            Some(free) => free
                .saturating_sub(self.cfg.disk_reserve)
                .saturating_sub(self.pending_disk),
            None => u64::MAX,
        }
    }

    pub(super) fn writer_waiting(&self, ks: &KeyState, prio: Priority) -> bool {
        match prio {
            Priority::Foreground => ks.exclusive_waiting[0] > 0,
            Priority::Background => ks.exclusive_waiting[0] + ks.exclusive_waiting[1] > 0,
        }
    }

    /// A7: would `head` still fit after granting `cand`? For every resource `cand` takes,
    /// what is left must still cover the head (resources `cand` does not touch are not
    /// its doing); and the two must not conflict on a key. So capacity the head needs
    /// only ever drains towards it.
    pub(crate) fn head_fits_after(&self, head: Slot, cand: Slot) -> bool {
        let h = self.run(head);
        let c = self.run(cand);
        for i in 0..self.allocatable.len() {
            if c.amounts[i] > 0
                && self.committed[i]
                    .saturating_add(h.amounts[i])
                    .saturating_add(c.amounts[i])
                    > self.allocatable[i]
            {
                return false;
            }
        }
        if c.amounts[MEMORY] > 0
            && h.amounts[MEMORY].saturating_add(c.amounts[MEMORY]) > self.ambient_free()
        {
            return false;
        }
        if c.amounts[DISK] > 0
            && h.amounts[DISK].saturating_add(c.amounts[DISK]) > self.disk_ambient_free()
        {
            return false;
        }
        for &(hk, hm) in &h.keys {
            for &(ck, cm) in &c.keys {
                if hk == ck && (hm == KeyMode::Exclusive || cm == KeyMode::Exclusive) {
                    return false;
                }
            }
        }
        // B2: a token of the head's harness must still be left for the head.
        if let (Some(hb), Some(cb)) = (&h.req.budget, &c.req.budget) {
            if hb.scope == cb.scope && hb.harness == cb.harness {
                let left = self.scopes.get(&hb.scope).map_or(0, |sc| {
                    let limit = sc.policy.get(&hb.harness).copied().unwrap_or(0) as usize;
                    limit.saturating_sub(sc.holders(&hb.harness))
                });
                if left < 2 {
                    return false;
                }
            }
        }
        true
    }

    pub(crate) fn guard_active(&self, head: Slot) -> bool {
        self.now.saturating_sub(self.run(head).enqueued_at) > self.cfg.starvation_guard_ms
    }

    /// One admission pass: upgrades first (C4), then per band the head's first pick and a
    /// rotating window of later waiters (A6), under the starvation guard (A7). Work is
    /// bounded by `slots_max + window + 1` evaluations, whatever the queue's depth.
    pub(super) fn pass(&mut self, now: TimeMs, extra: Option<Slot>, ev: &mut Vec<Event>) {
        self.service_upgrades(ev);
        let mut buf = std::mem::take(&mut self.window_buf);
        for band in 0..2 {
            if band == 1 && !self.queues[0].is_empty() {
                break; // A5: background only while no foreground run waits.
            }
            while let Some((_, h)) = self.queues[band].head() {
                match self.blocker(h, true) {
                    None => self.grant(h, now, ev),
                    Some(Blocker::Permit) => {
                        self.want_permit(h, ev);
                        break;
                    }
                    Some(_) => break,
                }
            }
            let Some((_, head)) = self.queues[band].head() else {
                continue;
            };
            let guard = self.guard_active(head);
            self.queues[band].window(self.cfg.window, &mut buf);
            if let Some(x) = extra {
                let r = self.run(x);
                if r.state == RunState::Queued
                    && r.req.priority.index() == band
                    && x != head
                    && !buf.iter().any(|&(_, s)| s == x)
                {
                    buf.push((r.seq, x));
                }
            }
            for &(seq, s) in &buf {
                let Some(Some(r)) = self.runs.get(s as usize) else {
                    continue;
                };
                if r.state != RunState::Queued || r.seq != seq {
                    continue;
                }
                let blocker = self.blocker(s, false);
                let fits = !guard || self.head_fits_after(head, s);
                match blocker {
                    None if fits => self.grant(s, now, ev),
                    Some(Blocker::Permit) if fits => self.want_permit(s, ev),
                    _ if !fits && self.run(s).permit.is_some() => self.return_permit(s, ev),
                    _ => {}
                }
            }
        }
        self.window_buf = buf;
    }

    pub(super) fn service_upgrades(&mut self, ev: &mut Vec<Event>) {
        if self.keys_with_upgrades.is_empty() {
            return;
        }
        let keys: Vec<KeyId> = self.keys_with_upgrades.iter().copied().collect();
        for k in keys {
            let ks = self.key_mut(k);
            if ks.exclusive.is_none() && ks.shared == 0 {
                if let Some(s) = ks.upgrades.pop_front() {
                    ks.exclusive = Some(s);
                    let name = ks.name.clone();
                    self.run_mut(s).upgrade = None;
                    ev.push(Event::UpgradeGranted {
                        run_id: self.run(s).req.run_id.clone(),
                        key: name,
                    });
                }
            }
            if self.key(k).upgrades.is_empty() {
                self.keys_with_upgrades.remove(&k);
            }
        }
    }

    pub(super) fn grant(&mut self, s: Slot, now: TimeMs, ev: &mut Vec<Event>) {
        {
            let r = self.run(s);
            // A8: never after the deadline (a `wait_s = 0` run is tried at its arrival).
            assert!(
                now < r.deadline || (r.req.wait_ms == 0 && now == r.enqueued_at),
                "A8: grant after deadline"
            );
        }
        // A5: a background grant while foreground waits would be a bug; it is counted
        // here and reported by `check_invariants` (which every test runs after each step).
        if self.run(s).req.priority == Priority::Background && !self.queues[0].is_empty() {
            self.background_grants_while_foreground_waits += 1;
        }
        self.unqueue(s);
        self.set_state(s, RunState::Granted);
        // F1: a fleet host's fence comes from the fleet's one sequence (unique fleet-wide,
        // not always above this host's last: another run's permit may have come first).
        let fence = self.run(s).permit.unwrap_or(self.last_fence + 1);
        self.last_fence = self.last_fence.max(fence);
        let settle = now.saturating_add(self.cfg.pending_settle_ms);
        let (keys, amounts) = {
            let r = self.run(s);
            (r.keys.clone(), r.amounts.clone())
        };
        for (c, a) in self.committed.iter_mut().zip(amounts.iter()) {
            *c += a;
        }
        for &(k, mode) in &keys {
            let ks = self.key_mut(k);
            match mode {
                KeyMode::Exclusive => {
                    assert!(ks.exclusive.is_none() && ks.shared == 0, "A4");
                    ks.exclusive = Some(s);
                }
                KeyMode::Shared => {
                    assert!(ks.exclusive.is_none(), "A4");
                    ks.shared += 1;
                }
            }
        }
        let pending = amounts[MEMORY] > 0 || amounts[DISK] > 0;
        if pending {
            self.pending_memory += amounts[MEMORY];
            self.pending_disk += amounts[DISK];
            self.pending.push_back((settle, s, fence));
        }
        self.take_token(s, now, ev);
        let run = self.run_mut(s);
        run.fence = Some(fence);
        run.granted_at = now;
        run.expires_at = now.saturating_add(run.req.ttl_ms);
        run.pending_mem = pending;
        let expires_at = run.expires_at;
        let run_id = run.req.run_id.clone();
        self.expiries.insert((expires_at, s));
        let key_names: Vec<(String, KeyMode)> = keys
            .iter()
            .map(|&(k, m)| (self.key(k).name.clone(), m))
            .collect();
        ev.push(Event::Granted {
            run_id,
            fence,
            expires_at_ms: expires_at,
            keys: key_names,
        });
    }
}
