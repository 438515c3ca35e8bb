//! Budgets and scopes (B1–B5, S1–S11): tokens taken at grant and given back at end,
//! reservations, reconciling, scope control and the idle-scope prune.

use super::*;

impl Engine {
    /// B6: a scope's waiters in admission order with their positions (at most
    /// `limit` of them), and how many it has in all.
    pub fn scope_waiters(&self, scope: &str, limit: usize) -> (Vec<RunView>, usize) {
        let mut views = Vec::new();
        let mut all = 0;
        for (_, s) in self.queues[0].iter().chain(self.queues[1].iter()) {
            let b = self.run(s).req.budget.as_deref();
            if b.is_some_and(|b| b.scope == scope) {
                all += 1;
                if views.len() < limit {
                    views.push(self.view(s));
                }
            }
        }
        (views, all)
    }

    /// B1, B2, B4: whether a new run's budget may queue at all (nothing changes): the
    /// policy and manifest match what is frozen, the harness is the policy's, the scope
    /// is not stopped, and the run's key holds no token of another harness.
    pub(super) fn check_budget(
        &self,
        run_id: &str,
        b: &crate::scopes::Budget,
        tenant: Option<u32>,
    ) -> Result<(), Error> {
        let sc = &self.scopes;
        sc.check_freeze(
            &b.scope,
            b.per_harness.as_ref(),
            b.manifest.as_ref(),
            tenant,
        )
        .map_err(Error::from)?;
        // A scope not used here yet may be stopped fleet-wide already (B4 fleet-wide).
        let control = (sc.get(&b.scope).map(|s| s.control))
            .or_else(|| sc.pending(&b.scope).map(|r| r.control));
        if control == Some(crate::scopes::Control::Stopped) {
            return Err(Error::from(ScopeError::Stopped {
                scope: b.scope.clone(),
            }));
        }
        let policy = match sc.get(&b.scope) {
            Some(s) => &s.policy,
            None => b.per_harness.as_ref().expect("check_freeze requires it"),
        };
        if !policy.contains_key(&b.harness) {
            return Err(Error::from(ScopeError::UnknownHarness {
                scope: b.scope.clone(),
                harness: b.harness.clone(),
            }));
        }
        match sc.token(&b.scope, run_id, b.operation()) {
            Some(t) if t.harness != b.harness => {
                Err(Error::from(ScopeError::ReservationConflict {
                    scope: b.scope.clone(),
                    held: t.harness.clone(),
                    given: b.harness.clone(),
                }))
            }
            _ => Ok(()),
        }
    }

    /// B1: the last refusal; past it the scope's policy freezes with this admission, and
    /// the run keeps only its scope, harness and operation (the scope holds the policy:
    /// a deep queue does not hold a copy per run).
    pub(super) fn freeze_budget(
        &mut self,
        now: TimeMs,
        req: &mut Request,
        tenant: Option<u32>,
        ev: &mut Vec<Event>,
    ) -> Result<(), Error> {
        let Some(b) = req.budget.as_deref_mut() else {
            return Ok(());
        };
        self.check_budget(&req.run_id, b, tenant)?;
        let (policy, manifest) = (b.per_harness.as_ref(), b.manifest.as_ref());
        let frozen = self
            .scopes
            .freeze(&b.scope, policy, manifest, tenant, now)
            .map_err(Error::from)?;
        if frozen {
            ev.push(Event::ScopeFrozen {
                scope: b.scope.clone(),
            });
            // A fleet control decided before this host used the scope.
            if let Some(r) = self.scopes.take_pending(&b.scope) {
                self.fleet_control(&b.scope, r, ev);
            }
        }
        b.per_harness = None;
        b.manifest = None;
        self.scopes.count_user(&b.scope, true, now);
        Ok(())
    }

    /// The live run whose claim holds `owner`'s token for `operation` in `scope`, if
    /// any: that token comes back with the run's release, not on its own (A1).
    pub(super) fn claim_holder(&self, scope: &str, owner: &str, operation: &str) -> Option<String> {
        let t = self.scopes.token(scope, owner, operation)?;
        let run_id = t.run_id.as_deref()?;
        let s = *self.by_id.get(run_id)?;
        let r = self.run(s);
        let own = r
            .req
            .budget
            .as_deref()
            .is_some_and(|b| b.scope == scope && b.operation() == operation);
        (own && r.req.run_id == owner && r.state.holds_claim()).then(|| run_id.to_string())
    }

    /// B2: a turn's reservation. Never queues: a full harness, a paused or stopped
    /// scope is refused at once (the caller retries with the same key).
    pub(super) fn reserve(
        &mut self,
        now: TimeMs,
        scope: &str,
        owner: &str,
        operation: &str,
        harness: &str,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        crate::scopes::check_id("owner", owner).map_err(Error::from)?;
        crate::scopes::check_id("operation_id", operation).map_err(Error::from)?;
        crate::scopes::check_harness(harness).map_err(|rule| {
            Error::from(ScopeError::Invalid {
                field: "harness",
                rule,
            })
        })?;
        // A live run's own key is its claim's: a turn cannot take it from under it.
        if let Some(&s) = self.by_id.get(owner) {
            let r = self.run(s);
            let b = r.req.budget.as_deref();
            if !r.state.is_terminal()
                && b.is_some_and(|b| b.scope == scope && b.operation() == operation)
            {
                let (scope, run_id) = (scope.to_string(), owner.to_string());
                return Err(Error::from(ScopeError::InUse { scope, run_id }));
            }
        }
        let taken = self
            .scopes
            .reserve(now, scope, owner, operation, harness, None)
            .map_err(Error::from)?;
        if taken == crate::scopes::Reserved::New {
            ev.push(Event::TokenTaken {
                scope: scope.to_string(),
                owner: owner.to_string(),
                operation: operation.to_string(),
                harness: harness.to_string(),
                run_id: None,
            });
        }
        Ok(None)
    }

    /// B3: the owner gives a token back; a live run's own token comes back only with
    /// the run.
    pub(super) fn unreserve(
        &mut self,
        scope: &str,
        owner: &str,
        operation: &str,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        if let Some(run_id) = self.claim_holder(scope, owner, operation) {
            let scope = scope.to_string();
            return Err(Error::from(ScopeError::InUse { scope, run_id }));
        }
        let t = self
            .scopes
            .release(scope, owner, operation)
            .map_err(Error::from)?;
        self.scopes.touch(scope, self.now);
        ev.push(Event::TokenFreed {
            scope: scope.to_string(),
            owner: owner.to_string(),
            operation: operation.to_string(),
            harness: t.harness,
            reconciled: false,
        });
        Ok(None)
    }

    /// S10: an operator forgets an idle scope.
    pub(super) fn delete_scope(
        &mut self,
        scope: String,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        self.scopes.delete(&scope).map_err(Error::from)?;
        ev.push(Event::ScopeForgotten {
            scope,
            by_operator: true,
        });
        Ok(None)
    }

    /// S10: scopes idle past the idle window are forgotten, looked for at most once a
    /// minute (or half the window).
    pub(super) fn prune_scopes(&mut self, now: TimeMs, ev: &mut Vec<Event>) {
        if now < self.scope_prune_at {
            return;
        }
        // A short window (a test's) is looked at within half of it.
        let every = SCOPE_PRUNE_EVERY_MS.min(self.cfg.scope_idle_ms / 2);
        self.scope_prune_at = now.saturating_add(every);
        for scope in self.scopes.prune_idle(now, self.cfg.scope_idle_ms) {
            ev.push(Event::ScopeForgotten {
                scope,
                by_operator: false,
            });
        }
    }

    /// B3: an operator frees every token `owner` holds in the scope, all or none: a
    /// live run's own token is refused (its release gives it back).
    pub(super) fn reconcile(
        &mut self,
        scope: &str,
        owner: &str,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        crate::scopes::check_id("owner", owner).map_err(Error::from)?;
        for (op, _) in self.scopes.owner_operations(scope, owner) {
            if let Some(run_id) = self.claim_holder(scope, owner, &op) {
                let scope = scope.to_string();
                return Err(Error::from(ScopeError::InUse { scope, run_id }));
            }
        }
        self.scopes.touch(scope, self.now);
        for (operation, t) in self.scopes.reconcile(scope, owner).map_err(Error::from)? {
            ev.push(Event::TokenFreed {
                scope: scope.to_string(),
                owner: owner.to_string(),
                operation,
                harness: t.harness,
                reconciled: true,
            });
        }
        Ok(None)
    }

    /// B4: a control request. Once a scope stops, its waiters are refused at once
    /// (ended `rejected`); the runs holding tokens keep them.
    pub(super) fn scope_control(
        &mut self,
        now: TimeMs,
        scope: &str,
        request_id: &str,
        mode: crate::scopes::Mode,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let retry = self
            .scopes
            .get(scope)
            .is_some_and(|s| s.receipts.iter().any(|r| r.request_id == request_id));
        let receipt = self
            .scopes
            .control(now, scope, request_id, mode)
            .map_err(Error::from)?;
        if retry {
            return Ok(None); // the same receipt again: nothing changed
        }
        self.controlled(scope, receipt, ev);
        Ok(None)
    }

    /// B4 fleet-wide: a control the fleet store decided, taken if it is newer than
    /// what the scope has (or held until the scope is used here).
    pub(super) fn fleet_control(
        &mut self,
        scope: &str,
        receipt: crate::scopes::Receipt,
        ev: &mut Vec<Event>,
    ) {
        if self.scopes.mirror(scope, receipt.clone()) {
            self.controlled(scope, receipt, ev);
        }
    }

    /// A control taken: its event, and once a scope stops its waiters are refused at
    /// once (ended `rejected`); the runs holding tokens keep them.
    fn controlled(&mut self, scope: &str, receipt: crate::scopes::Receipt, ev: &mut Vec<Event>) {
        let stopped = receipt.control == crate::scopes::Control::Stopped;
        ev.push(Event::ScopeControlled {
            scope: scope.to_string(),
            receipt,
        });
        if stopped {
            let waiters: Vec<Slot> = self
                .queues
                .iter()
                .flat_map(|q| q.iter())
                .map(|(_, s)| s)
                .filter(|&s| {
                    let b = self.run(s).req.budget.as_deref();
                    b.is_some_and(|b| b.scope == scope)
                })
                .collect();
            for s in waiters {
                self.unqueue(s);
                self.end(s, RunState::Rejected, ev);
            }
        }
    }

    /// B2: the granted run's token, taken in the step that grants it (A1). Its key may
    /// hold one already (a run id's earlier incarnation): that one is reused.
    pub(super) fn take_token(&mut self, s: Slot, now: TimeMs, ev: &mut Vec<Event>) {
        // The run's slot and the scopes are separate fields: borrowed apart.
        let run = self.runs[s as usize].as_deref().expect("live slot");
        let Some(b) = run.req.budget.as_deref() else {
            return;
        };
        let (owner, op) = (run.req.run_id.as_str(), b.operation());
        let taken = self
            .scopes
            .reserve(now, &b.scope, owner, op, &b.harness, Some(owner))
            .expect("blocker() let the token through");
        if taken == crate::scopes::Reserved::Existing {
            self.scopes.adopt(&b.scope, owner, op, owner);
        }
        ev.push(Event::TokenTaken {
            scope: b.scope.clone(),
            owner: owner.to_string(),
            operation: op.to_string(),
            harness: b.harness.clone(),
            run_id: Some(owner.to_string()),
        });
    }

    /// B3: the run's owner released it: its own token comes back with its claim. (A
    /// lapsed run keeps it: only its owner's explicit release or a reconciliation
    /// frees it.)
    pub(super) fn give_token_back(&mut self, s: Slot, ev: &mut Vec<Event>) {
        let run = self.run(s);
        let Some(b) = run.req.budget.as_deref() else {
            return;
        };
        let (owner, op) = (run.req.run_id.clone(), b.operation().to_string());
        let scope = b.scope.clone();
        if let Ok(t) = self.scopes.release(&scope, &owner, &op) {
            self.scopes.touch(&scope, self.now);
            ev.push(Event::TokenFreed {
                scope,
                owner,
                operation: op,
                harness: t.harness,
                reconciled: false,
            });
        }
    }
}
