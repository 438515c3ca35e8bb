//! Promotion (C1–C5): a run's contract evidence turns its project's exclusive runtime
//! key into a shared one; demotion and evidence invalidation turn it back.

use super::*;

impl Engine {
    /// C3: a granted foreground run whose parallel contract started proves its project
    /// parallel-safe: the evidence is recorded, the prover's exclusive hold becomes
    /// shared, and queued runs with the same contract become shared claimants, granted
    /// at once where they fit.
    pub(super) fn promote(
        &mut self,
        now: TimeMs,
        run_id: &str,
        fence: Fence,
        ports: Vec<String>,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let s = self.granted_with_fence(run_id, fence)?;
        if ports.len() > PORTS_MAX {
            return Err(Error::Invalid {
                field: "ports",
                rule: format!("at most {PORTS_MAX} entries"),
            });
        }
        let contract = self.promotable(s)?;
        let run = self.run(s);
        let (p, (k, held_mode)) = (run.project, run.keys[0]);
        let evidence = Evidence {
            fingerprint: contract.fingerprint.clone(),
            commit: contract.commit.clone(),
            ports,
            at_ms: now,
            run_id: run_id.to_string(),
        };
        self.project_mut(p).evidence = Some(evidence.clone());
        ev.push(Event::Promoted {
            project: self.project(p).name.clone(),
            evidence: evidence.clone(),
        });
        if held_mode == KeyMode::Exclusive {
            // The prover's exclusive hold becomes a shared one at once.
            let ks = self.key_mut(k);
            assert_eq!(ks.exclusive, Some(s));
            ks.exclusive = None;
            ks.shared += 1;
            self.share_primary_key(s, ev);
        }
        let converted = self.convert_waiters(k, &evidence, ev);
        self.grant_converted(converted, now, ev);
        Ok(Some(self.view(s)))
    }

    /// "Into shared holders at once": each converted waiter that fits is granted now,
    /// in queue order, ahead of the window. Like the head, it is exempt from writer
    /// preference: it was already queued for this key before the promotion. The
    /// starvation guard (A7) still applies to those behind the head.
    fn grant_converted(&mut self, converted: Vec<Slot>, now: TimeMs, ev: &mut Vec<Event>) {
        let head = self.queues[0].head().map(|(_, h)| h);
        for w in converted {
            let guard_ok = match head {
                Some(h) if h != w && self.guard_active(h) => self.head_fits_after(h, w),
                _ => true,
            };
            if guard_ok && self.blocker(w, true).is_none() {
                self.grant(w, now, ev);
            }
        }
    }

    /// C3/C4 fleet-wide: evidence proven on another host (or found wrong there). Valid
    /// evidence the project does not hold replaces what it holds (whose riders go back
    /// to waiting for the key exclusively first); the exclusive holder with that
    /// contract and its queued foreground runs with it become shared, as at a promotion
    /// here, and those that fit are granted; invalid evidence is dropped only if it is
    /// the project's.
    pub(super) fn fleet_evidence(
        &mut self,
        now: TimeMs,
        project: &str,
        e: Evidence,
        valid: bool,
        ev: &mut Vec<Event>,
    ) {
        let same = |x: &Evidence| x.fingerprint == e.fingerprint && x.commit == e.commit;
        let known = self.project_ids.get(&lower(project)).copied();
        let held = known.and_then(|p| self.project(p).evidence.as_ref().map(same));
        match (valid, held) {
            (true, Some(true)) | (false, None | Some(false)) => return,
            (false, Some(true)) => {
                let p = known.expect("held");
                self.invalidate_evidence(p, &e.run_id, ev);
                self.gc_project(p);
                return;
            }
            (true, Some(false)) => self.invalidate_evidence(known.expect("held"), &e.run_id, ev),
            (true, None) => {}
        }
        let p = self.intern_project(project);
        self.project_mut(p).evidence = Some(e.clone());
        let name = self.project(p).name.clone();
        ev.push(Event::Promoted {
            project: name.clone(),
            evidence: e.clone(),
        });
        let Some(&k) = self.key_ids.get(&runtime_key(&name)) else {
            return;
        };
        // The holder here would have been the prover had it been first: with the same
        // contract, its exclusive hold becomes shared as a prover's does.
        if let Some(h) = self.key(k).exclusive {
            let r = self.run(h);
            let rides = r.keys[0] == (k, KeyMode::Exclusive)
                && r.req.class == Class::Managed
                && r.req.priority == Priority::Foreground
                && r.upgrade.is_none()
                && contract_matches(&r.contract, &e);
            if rides {
                let ks = self.key_mut(k);
                ks.exclusive = None;
                ks.shared += 1;
                self.share_primary_key(h, ev);
            }
        }
        let converted = self.convert_waiters(k, &e, ev);
        self.grant_converted(converted, now, ev);
    }

    /// Whether the run at `s` may prove its project parallel (C3, C5): its contract, or
    /// why not.
    pub(super) fn promotable(&self, s: Slot) -> Result<ContractInfo, Error> {
        let run = self.run(s);
        let not = |why: &str| Error::NotEligible {
            run_id: run.req.run_id.clone(),
            why: why.to_string(),
        };
        if run.req.class != Class::Managed {
            return Err(not("only managed runs prove a project parallel"));
        }
        if run.req.priority != Priority::Foreground {
            return Err(not("background runs never promote a project (C5)"));
        }
        let Some(contract) = run.contract.clone() else {
            return Err(not("the run has no runtime contract"));
        };
        if contract.concurrency != Concurrency::Parallel {
            return Err(not("the run's contract does not ask for parallel"));
        }
        if run.upgrade.is_some() {
            return Err(not(
                "the run is waiting to hold the runtime key exclusively",
            ));
        }
        Ok(contract)
    }

    /// The run's claim on its project's runtime key becomes shared (it rides on the
    /// promotion), journaled.
    pub(super) fn share_primary_key(&mut self, s: Slot, ev: &mut Vec<Event>) {
        let k = self.run(s).keys[0].0;
        let key = self.key(k).name.clone();
        let run = self.run_mut(s);
        run.keys[0].1 = KeyMode::Shared;
        run.promoted_shared = true;
        let run_id = run.req.run_id.clone();
        ev.push(Event::KeyModeChanged {
            run_id,
            key,
            mode: KeyMode::Shared,
        });
    }

    /// C3: queued foreground exclusive waiters on `k` with the evidence's contract and
    /// commit become shared claimants (in queue order); the pass grants those that fit.
    pub(super) fn convert_waiters(
        &mut self,
        k: KeyId,
        evidence: &Evidence,
        ev: &mut Vec<Event>,
    ) -> Vec<Slot> {
        let waiters: Vec<Slot> = self
            .key(k)
            .waiters
            .iter()
            .filter(|(prio, _, _)| *prio == Priority::Foreground)
            .map(|&(_, _, w)| w)
            .collect();
        let mut converted = Vec::new();
        for w in waiters {
            let r = self.run(w);
            if r.keys[0] == (k, KeyMode::Exclusive)
                && r.req.class == Class::Managed
                && contract_matches(&r.contract, evidence)
            {
                self.key_mut(k).exclusive_waiting[0] -= 1;
                self.share_primary_key(w, ev);
                converted.push(w);
            }
        }
        converted
    }

    pub(super) fn demote(
        &mut self,
        run_id: &str,
        fence: Fence,
        fingerprint: String,
        commit: Option<String>,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let s = self.granted_with_fence(run_id, fence)?;
        if self.run(s).req.class != Class::Managed {
            return Err(Error::NotEligible {
                run_id: run_id.to_string(),
                why: "only managed runs hold the runtime key".into(),
            });
        }
        if fingerprint.is_empty() || fingerprint.len() > 128 {
            return Err(Error::Invalid {
                field: "fingerprint",
                rule: "must be 1 to 128 characters".into(),
            });
        }
        let p = self.run(s).project;
        {
            let run = self.run_mut(s);
            let concurrency = run
                .contract
                .as_ref()
                .map_or(Concurrency::Serial, |c| c.concurrency);
            run.contract = Some(ContractInfo {
                concurrency,
                fingerprint,
                commit,
            });
        }
        let stale = match &self.project(p).evidence {
            Some(e) => !contract_matches(&self.run(s).contract, e),
            None => false,
        };
        if stale {
            self.invalidate_evidence(p, run_id, ev);
        }
        let (k, mode) = self.run(s).keys[0];
        if mode == KeyMode::Shared && !contract_matches_project(self, s) {
            // C4: queue for the exclusive key first, then give up the shared hold, in
            // one step, so nothing can slip in between. Upgrades go before any waiter.
            let key_name = self.key(k).name.clone();
            let ks = self.key_mut(k);
            ks.upgrades.push_back(s);
            ks.shared -= 1;
            self.keys_with_upgrades.insert(k);
            let run = self.run_mut(s);
            run.keys[0].1 = KeyMode::Exclusive;
            run.promoted_shared = false;
            run.upgrade = Some(k);
            ev.push(Event::UpgradeQueued {
                run_id: run_id.to_string(),
                key: key_name,
            });
        }
        Ok(Some(self.view(s)))
    }

    /// C4: a shared holder whose runtime failed to start proves the evidence wrong; a
    /// serial (exclusive) holder's failure says nothing about running in parallel.
    pub(super) fn runtime_failed(
        &mut self,
        run_id: &str,
        fence: Fence,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let s = self.granted_with_fence(run_id, fence)?;
        let run = self.run(s);
        if run.req.class == Class::Managed && run.keys[0].1 == KeyMode::Shared {
            let p = run.project;
            self.invalidate_evidence(p, run_id, ev);
        }
        Ok(Some(self.view(s)))
    }

    pub(super) fn invalidate_evidence(&mut self, p: ProjectId, by_run: &str, ev: &mut Vec<Event>) {
        let Some(evidence) = self.project_mut(p).evidence.take() else {
            return;
        };
        let name = self.project(p).name.clone();
        ev.push(Event::EvidenceInvalidated {
            project: name.clone(),
            by_run: by_run.to_string(),
            evidence,
        });
        // Waiters that would have ridden on the evidence claim the key exclusively again.
        // They hold nothing yet, so this cannot break anyone's hold (A1).
        let Some(&k) = self.key_ids.get(&runtime_key(&name)) else {
            return;
        };
        let waiters: Vec<(Priority, Slot)> = self
            .key(k)
            .waiters
            .iter()
            .map(|&(p, _, w)| (p, w))
            .collect();
        let key_name = self.key(k).name.clone();
        for (prio, w) in waiters {
            let r = self.run(w);
            if r.keys[0].0 == k && r.promoted_shared {
                self.key_mut(k).exclusive_waiting[prio.index()] += 1;
                let r = self.run_mut(w);
                r.keys[0].1 = KeyMode::Exclusive;
                r.promoted_shared = false;
                ev.push(Event::KeyModeChanged {
                    run_id: r.req.run_id.clone(),
                    key: key_name.clone(),
                    mode: KeyMode::Exclusive,
                });
            }
        }
    }
}

pub(super) fn contract_matches(c: &Option<ContractInfo>, e: &Evidence) -> bool {
    matches!(c, Some(c) if c.concurrency == Concurrency::Parallel
        && c.fingerprint == e.fingerprint && c.commit == e.commit)
}

pub(super) fn contract_matches_project(e: &Engine, s: Slot) -> bool {
    let r = e.run(s);
    match &e.project(r.project).evidence {
        Some(ev) => contract_matches(&r.contract, ev),
        None => false,
    }
}

/// Exposed for the snapshot module.
pub(crate) fn concurrency_class(p: &ProjectState) -> ConcurrencyClass {
    if p.evidence.is_some() {
        ConcurrencyClass::ParallelSafe
    } else if p.parallel_asked {
        ConcurrencyClass::ParallelCandidate
    } else {
        ConcurrencyClass::Serial
    }
}
