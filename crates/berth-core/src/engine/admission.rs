//! Admission: `acquire` as refuse → freeze the budget → claim → enqueue → pass, the
//! request checks it runs first (A1, A3, B5), the key names a request claims, and the
//! fleet permit (F1) a waiter asks for once everything local fits.

use super::*;

/// A run refused nothing and claimed in full, ready to be queued (`Engine::enqueue`).
pub(super) struct Queued {
    pub(super) req: Request,
    pub(super) project: ProjectId,
    pub(super) amounts: Box<[u64]>,
    pub(super) keys: Vec<(KeyId, KeyMode)>,
    pub(super) promoted_shared: bool,
    pub(super) permit: Option<Fence>,
}

impl Engine {
    /// A free slot for a new run (a freed one first).
    pub(super) fn alloc_slot(&mut self) -> Slot {
        self.free_slots.pop().unwrap_or_else(|| {
            self.runs.push(None);
            (self.runs.len() - 1) as Slot
        })
    }

    /// The run's keys, interned: the first (the project's runtime key) in `primary`
    /// mode, every other exclusive.
    pub(super) fn intern_keys(&mut self, req: &Request, primary: KeyMode) -> Vec<(KeyId, KeyMode)> {
        let names = key_names(req);
        let mut keys = Vec::with_capacity(names.len());
        for (i, name) in names.into_iter().enumerate() {
            let mode = if i == 0 { primary } else { KeyMode::Exclusive };
            keys.push((self.intern_key(name), mode));
        }
        keys
    }

    /// A queued run waits on each of its keys (an exclusive waiter is counted per band,
    /// for writer preference, A4).
    pub(super) fn wait_on_keys(
        &mut self,
        slot: Slot,
        seq: u64,
        prio: Priority,
        keys: &[(KeyId, KeyMode)],
    ) {
        for &(k, mode) in keys {
            let ks = self.key_mut(k);
            ks.waiters.insert((prio, seq, slot));
            if mode == KeyMode::Exclusive {
                ks.exclusive_waiting[prio.index()] += 1;
            }
        }
    }

    pub(super) fn validate_request(&self, req: &Request) -> Result<(), Error> {
        let inv = |field: &'static str, rule: String| Err(Error::Invalid { field, rule });
        if let Err(e) = validate::run_id(&req.run_id) {
            return inv("run_id", e);
        }
        if let Err(e) = validate::project(&req.project) {
            return inv("project", e);
        }
        if req.singletons.len() > SINGLETONS_MAX {
            return inv("singletons", format!("at most {SINGLETONS_MAX} entries"));
        }
        for s in &req.singletons {
            if let Err(e) = validate::resource_name(s) {
                return inv("singletons", e);
            }
            if s.strip_prefix(FLEET_SINGLETON_PREFIX) == Some("") {
                return inv("singletons", format!("{s:?} names no fleet-wide key"));
            }
        }
        let fleet_keys = req
            .singletons
            .iter()
            .filter(|s| s.starts_with(FLEET_SINGLETON_PREFIX))
            .count();
        if fleet_keys > FLEET_KEYS_MAX {
            return inv(
                "singletons",
                format!("at most {FLEET_KEYS_MAX} fleet-wide (fleet:NAME) entries"),
            );
        }
        if req.ttl_ms == 0 || req.ttl_ms > self.cfg.ttl_ms_max {
            return inv(
                "ttl_s",
                format!("must be between 1 s and {} s", self.cfg.ttl_ms_max / 1000),
            );
        }
        if req.wait_ms > self.cfg.wait_ms_max {
            return inv(
                "wait_s",
                format!("must be between 0 and {} s", self.cfg.wait_ms_max / 1000),
            );
        }
        if req.resources.slots == 0 {
            return inv("resources.slots", "must be at least 1".into());
        }
        for name in req.resources.named.keys() {
            if !self.cfg.named.iter().any(|(n, _)| n == name) {
                return inv(
                    "resources",
                    format!("{name:?} is not a resource this host declares"),
                );
            }
        }
        if let Some(c) = &req.contract {
            if c.fingerprint.is_empty() || c.fingerprint.len() > 128 {
                return inv("contract.fingerprint", "must be 1 to 128 characters".into());
            }
        }
        if let Some(b) = &req.budget {
            b.check().map_err(Error::from)?;
        }
        Ok(())
    }

    pub(super) fn amounts_of(&self, r: &Resources) -> Box<[u64]> {
        let mut a = vec![0u64; self.allocatable.len()];
        a[SLOTS] = r.slots;
        a[MEMORY] = r.memory;
        a[CPU] = r.cpu_millis;
        a[DISK] = r.disk;
        for (i, (name, _)) in self.cfg.named.iter().enumerate() {
            a[FIXED + i] = r.named.get(name).copied().unwrap_or(0);
        }
        a.into_boxed_slice()
    }

    /// A1–A3, B1, C3–C6, L7: refuse what cannot be, claim everything the run needs,
    /// enqueue it, and run a pass that considers it at once.
    pub(super) fn acquire(
        &mut self,
        now: TimeMs,
        req: Request,
        permit: Option<Fence>,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        self.validate_request(&req)?;
        if permit.is_some_and(|f| f == 0 || !self.cfg.fleet) {
            return Err(Error::Invalid {
                field: "permit",
                rule: "a permit is a positive fence, on a fleet host only".into(),
            });
        }
        let mut req = req;
        // S10: who sends it is no part of the request (L7 compares without it).
        let tenant = req.budget.as_deref_mut().and_then(|b| b.tenant.take());
        if let Some(b) = req.budget.as_deref() {
            // B1: a policy or manifest given must match the frozen one, on a retry too.
            if self.scopes.get(&b.scope).is_some() {
                let (policy, manifest) = (b.per_harness.as_ref(), b.manifest.as_ref());
                self.scopes
                    .check_freeze(&b.scope, policy, manifest, tenant)?;
            }
        }
        // L7: the same run_id re-attaches with the same body, conflicts with another.
        if let Some(&s) = self.by_id.get(&req.run_id) {
            let run = self.run(s);
            if !same_request(&run.req, &req) {
                return Err(Error::Conflict { run_id: req.run_id });
            }
            if run.state.is_terminal() {
                let state = run.state;
                return Err(Error::Gone {
                    run_id: req.run_id,
                    state,
                });
            }
            return Ok(self.view_of(&req.run_id));
        }
        let amounts = self.refuse(&req)?;
        self.freeze_budget(now, &mut req, tenant, ev)?;
        let (project, keys, promoted_shared) = self.claim(&req, ev);
        let wait_now = req.wait_ms == 0;
        let run_id = req.run_id.clone();
        let queued = Queued {
            req,
            project,
            amounts,
            keys,
            promoted_shared,
            permit,
        };
        let slot = self.enqueue(now, queued, ev);
        // The newcomer is considered in this very pass even if the window is elsewhere.
        self.pass(now, Some(slot), ev);
        if wait_now && self.run(slot).state == RunState::Queued {
            // `wait_s = 0`: not admitted at once means expired, with the reason why.
            self.expire_waiter(slot, ev);
            return Ok(Some(self.view(slot)));
        }
        Ok(self.view_of(&run_id))
    }

    /// What is refused before a run is queued: a disabled contract, a claim no empty
    /// host could hold (A3), a full queue. Answers the claim's amounts.
    pub(super) fn refuse(&self, req: &Request) -> Result<Box<[u64]>, Error> {
        if req
            .contract
            .as_ref()
            .is_some_and(|c| c.concurrency == Concurrency::Disabled)
        {
            return Err(Error::ContractDisabled {
                project: req.project.clone(),
            });
        }
        let amounts = self.amounts_of(&req.resources);
        for (i, (&need, &max)) in amounts.iter().zip(&self.allocatable).enumerate() {
            if need > max {
                return Err(Error::CapacityImpossible {
                    resource: self.res_names[i].clone(),
                    request: need,
                    max,
                });
            }
        }
        if self.queue_len() >= self.cfg.queue_len_max {
            return Err(Error::QueueFull {
                max: self.cfg.queue_len_max,
            });
        }
        Ok(amounts)
    }

    /// A1: the whole claim is known before queueing: the run's project, every key with
    /// its mode (the project's runtime key shared for an analysis run (C6) or a
    /// foreground run riding on matching promotion evidence (C3, C5), else exclusive),
    /// and whether it rides on promotion. Stale evidence is invalidated (C4).
    pub(super) fn claim(
        &mut self,
        req: &Request,
        ev: &mut Vec<Event>,
    ) -> (ProjectId, Vec<(KeyId, KeyMode)>, bool) {
        let p = self.intern_project(&req.project);
        let mut promoted_shared = false;
        let primary_mode = match req.class {
            Class::Analysis => KeyMode::Shared,
            Class::Managed => {
                if let Some(c) = &req.contract {
                    self.project_mut(p).parallel_asked = c.concurrency == Concurrency::Parallel;
                }
                match self.project(p).evidence.clone() {
                    Some(e) if req.contract.is_some() && !contract_matches(&req.contract, &e) => {
                        self.invalidate_evidence(p, &req.run_id, ev);
                        KeyMode::Exclusive
                    }
                    Some(e)
                        if req.priority == Priority::Foreground
                            && contract_matches(&req.contract, &e) =>
                    {
                        promoted_shared = true;
                        KeyMode::Shared
                    }
                    _ => KeyMode::Exclusive,
                }
            }
        };
        (p, self.intern_keys(req, primary_mode), promoted_shared)
    }

    /// Puts a claimed run at the back of its band, waiting on each of its keys, with
    /// its deadline; journals `Queued` with its position.
    pub(super) fn enqueue(&mut self, now: TimeMs, q: Queued, ev: &mut Vec<Event>) -> Slot {
        let slot = self.alloc_slot();
        let seq = self.queues[q.req.priority.index()].push(slot);
        let deadline = now.saturating_add(q.req.wait_ms);
        self.wait_on_keys(slot, seq, q.req.priority, &q.keys);
        self.deadlines.insert((deadline, slot));
        self.project_mut(q.project).waiting += 1;
        let run_id = q.req.run_id.clone();
        self.runs[slot as usize] = Some(Box::new(Run {
            contract: q.req.contract.clone(),
            req: q.req,
            project: q.project,
            amounts: q.amounts,
            keys: q.keys,
            promoted_shared: q.promoted_shared,
            state: RunState::Queued,
            seq,
            enqueued_at: now,
            deadline,
            fence: None,
            granted_at: 0,
            expires_at: 0,
            cause: None,
            upgrade: None,
            pending_mem: false,
            permit: q.permit,
            permit_asked: q.permit.is_some(),
            last_reason: None,
        }));
        self.by_id.insert(run_id.clone(), slot);
        let position = self.position(slot);
        ev.push(Event::Queued { run_id, position });
        slot
    }

    /// F1: ask the caller for this waiter's fleet-wide claim, once per permit it needs
    /// (again when the one it holds went stale: the caller then renews its fence).
    pub(super) fn want_permit(&mut self, s: Slot, ev: &mut Vec<Event>) {
        let last = self.last_fence;
        let run = self.run_mut(s);
        if run.permit.is_some_and(|f| f <= last) {
            run.permit = None;
            run.permit_asked = false;
        }
        if !run.permit_asked {
            run.permit_asked = true;
            let run_id = run.req.run_id.clone();
            ev.push(Event::PermitWanted { run_id });
        }
    }

    /// F1/A1 (issue 38 item 6): the waiter is held back for the head; the claim its
    /// permit stands for goes back (`Event::PermitReturned`).
    pub(super) fn return_permit(&mut self, s: Slot, ev: &mut Vec<Event>) {
        let run = self.run_mut(s);
        run.permit = None;
        run.permit_asked = false;
        let run_id = run.req.run_id.clone();
        ev.push(Event::PermitReturned { run_id });
    }

    /// F1: the fleet store holds the queued run's claim; its grant will carry `fence`.
    pub(super) fn permit(&mut self, run_id: &str, fence: Fence) -> Result<Option<RunView>, Error> {
        let Some(&s) = self.by_id.get(run_id) else {
            return Err(Error::NotFound {
                run_id: run_id.into(),
            });
        };
        let run = self.run(s);
        if !self.cfg.fleet || run.state != RunState::Queued || fence == 0 {
            return Err(Error::Invalid {
                field: "permit",
                rule: format!("run {run_id} is not a queued run of a fleet host"),
            });
        }
        self.run_mut(s).permit = Some(fence);
        Ok(None)
    }
}

pub(super) fn lower(s: &str) -> String {
    s.to_ascii_lowercase()
}

pub(crate) fn runtime_key(project: &str) -> String {
    format!("project:{}:runtime", lower(project))
}

pub(super) fn analysis_key(project: &str) -> String {
    format!("project:{}:analysis", lower(project))
}

pub(super) fn singleton_key(name: &str) -> String {
    format!("singleton:{name}")
}

/// The key names a request claims, in the order `Run::keys` holds them.
pub(super) fn key_names(req: &Request) -> Vec<String> {
    let mut names = vec![match req.class {
        Class::Managed => runtime_key(&req.project),
        Class::Analysis => analysis_key(&req.project),
    }];
    names.extend(sorted_singletons(req).into_iter().map(singleton_key));
    names
}

pub(super) fn sorted_singletons(req: &Request) -> Vec<&str> {
    let mut v: Vec<&str> = req.singletons.iter().map(String::as_str).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// L7: a retry is the same request. A budget's policy and manifest are not part of
/// what a run keeps (they are the scope's, and were checked against it), so they are
/// left out of the comparison.
pub(super) fn same_request(kept: &Request, given: &Request) -> bool {
    match given.budget.as_deref() {
        Some(b) if b.per_harness.is_some() || b.manifest.is_some() => {
            let mut g = given.clone();
            if let Some(b) = g.budget.as_deref_mut() {
                b.per_harness = None;
                b.manifest = None;
            }
            *kept == g
        }
        _ => kept == given,
    }
}
