//! The lease commands on a run that exists: cancel, renew, release, the end of a stop,
//! the fence check (L1, L2), and the one place a run ends (`end`).

use super::*;

impl Engine {
    pub(super) fn cancel(
        &mut self,
        run_id: &str,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let s = self.lookup(run_id)?;
        match self.run(s).state {
            RunState::Queued => {
                self.unqueue(s);
                self.end(s, RunState::Cancelled, ev);
                Ok(Some(self.view(s)))
            }
            RunState::Cancelled => Ok(Some(self.view(s))),
            state @ (RunState::Granted | RunState::Releasing | RunState::Degraded) => {
                Err(Error::FenceRequired {
                    run_id: run_id.to_string(),
                    state,
                })
            }
            state => Err(Error::Gone {
                run_id: run_id.to_string(),
                state,
            }),
        }
    }

    pub(super) fn renew(
        &mut self,
        now: TimeMs,
        run_id: &str,
        fence: Option<Fence>,
        ttl_ms: Option<u64>,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let s = self.lookup(run_id)?;
        if let Some(t) = ttl_ms {
            if t == 0 || t > self.cfg.ttl_ms_max {
                return Err(Error::Invalid {
                    field: "ttl_s",
                    rule: format!("must be between 1 s and {} s", self.cfg.ttl_ms_max / 1000),
                });
            }
        }
        self.check_fence(s, fence)?;
        let (state, ttl, deadline, expires_at) = {
            let r = self.run(s);
            (
                r.state,
                ttl_ms.unwrap_or(r.req.ttl_ms),
                r.deadline,
                r.expires_at,
            )
        };
        match state {
            RunState::Queued => {
                // L4: renewing a queued run extends (never shortens) its queue deadline.
                let old = deadline;
                let new = old.max(now.saturating_add(ttl.min(self.cfg.wait_ms_max)));
                self.deadlines.remove(&(old, s));
                self.deadlines.insert((new, s));
                self.run_mut(s).deadline = new;
                ev.push(Event::QueueDeadlineExtended {
                    run_id: run_id.to_string(),
                    deadline_ms: new,
                });
            }
            RunState::Granted => {
                // Extends, never shortens: a late retry with a small ttl is harmless.
                let old = expires_at;
                let new = old.max(now.saturating_add(ttl));
                self.expiries.remove(&(old, s));
                self.expiries.insert((new, s));
                self.run_mut(s).expires_at = new;
                ev.push(Event::Renewed {
                    run_id: run_id.to_string(),
                    expires_at_ms: new,
                });
            }
            state => {
                return Err(Error::Gone {
                    run_id: run_id.to_string(),
                    state,
                })
            }
        }
        Ok(Some(self.view(s)))
    }

    /// L2: a call that acts on a granted run must carry its fence; a queued run has none.
    pub(super) fn check_fence(&self, s: Slot, fence: Option<Fence>) -> Result<(), Error> {
        let run = self.run(s);
        match (run.fence, fence) {
            (None, None) => Ok(()),
            (Some(cur), Some(f)) if cur == f => Ok(()),
            (Some(_), None) if !run.state.is_terminal() => Err(Error::FenceRequired {
                run_id: run.req.run_id.clone(),
                state: run.state,
            }),
            (Some(_), None) => Err(Error::Gone {
                run_id: run.req.run_id.clone(),
                state: run.state,
            }),
            (cur, given) => Err(Error::StaleFence {
                run_id: run.req.run_id.clone(),
                given,
                current: cur,
            }),
        }
    }

    pub(super) fn release(
        &mut self,
        run_id: &str,
        fence: Fence,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let s = self.lookup(run_id)?;
        self.check_fence(s, Some(fence))?;
        if self.run(s).state == RunState::Granted {
            self.begin_stop(s, EndCause::Released, ev);
        }
        // Releasing, degraded or ended with the same fence: idempotent (L5).
        Ok(Some(self.view(s)))
    }

    pub(super) fn stop_done(
        &mut self,
        run_id: &str,
        ok: bool,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let s = self.lookup(run_id)?;
        let state = self.run(s).state;
        match (state, ok) {
            (RunState::Releasing | RunState::Degraded, true) => {
                let cause = self.run(s).cause.expect("stopping run has a cause");
                self.free_claim(s);
                if cause == EndCause::Released {
                    self.give_token_back(s, ev);
                }
                self.end(s, cause.terminal_state(), ev);
            }
            (RunState::Releasing, false) => {
                self.set_state(s, RunState::Degraded);
                ev.push(Event::Degraded {
                    run_id: run_id.to_string(),
                });
            }
            (RunState::Degraded, false) => {}
            (state, _) => {
                return Err(Error::NotEligible {
                    run_id: run_id.to_string(),
                    why: format!("is {}, not being stopped", state.as_str()),
                })
            }
        }
        Ok(Some(self.view(s)))
    }

    pub(super) fn granted_with_fence(&self, run_id: &str, fence: Fence) -> Result<Slot, Error> {
        let s = self.lookup(run_id)?;
        self.check_fence(s, Some(fence))?;
        match self.run(s).state {
            RunState::Granted => Ok(s),
            state => Err(Error::Gone {
                run_id: run_id.to_string(),
                state,
            }),
        }
    }

    /// A8: a waiter whose wait ran out leaves the queue as expired, holding nothing,
    /// and keeps what it was last waiting on for its answer (A11).
    pub(super) fn expire_waiter(&mut self, s: Slot, ev: &mut Vec<Event>) {
        let reason = self.reason(s);
        self.unqueue(s);
        self.run_mut(s).last_reason = Some(Box::new(reason));
        self.end(s, RunState::Expired, ev);
    }

    pub(super) fn begin_stop(&mut self, s: Slot, cause: EndCause, ev: &mut Vec<Event>) {
        let expires_at = self.run(s).expires_at;
        self.expiries.remove(&(expires_at, s));
        self.set_state(s, RunState::Releasing);
        self.run_mut(s).cause = Some(cause);
        ev.push(Event::StopRequested {
            run_id: self.run(s).req.run_id.clone(),
            cause,
        });
        // B3: a lapsed lease stops the run, but its owner's tokens stay held, marked.
        if cause == EndCause::Expired {
            let run = self.run(s);
            if let Some(b) = &run.req.budget {
                let (scope, owner) = (b.scope.clone(), run.req.run_id.clone());
                for operation in self.scopes.lapse_owner(&scope, &owner) {
                    ev.push(Event::TokenLapsed {
                        scope: scope.clone(),
                        owner: owner.clone(),
                        operation,
                    });
                }
            }
        }
    }

    /// Returns everything a run holds to the host: resources, keys, pending memory.
    pub(super) fn free_claim(&mut self, s: Slot) {
        let run = self.runs[s as usize].as_ref().expect("live slot");
        assert!(run.state.holds_claim());
        for (c, a) in self.committed.iter_mut().zip(run.amounts.iter()) {
            *c -= a;
        }
        let keys = run.keys.clone();
        let upgrade = run.upgrade;
        if run.pending_mem {
            self.pending_memory -= run.amounts[MEMORY];
            self.pending_disk -= run.amounts[DISK];
        }
        for (k, mode) in keys {
            let ks = self.key_mut(k);
            if upgrade == Some(k) {
                ks.upgrades.retain(|&u| u != s);
            } else if mode == KeyMode::Exclusive {
                assert_eq!(ks.exclusive, Some(s));
                ks.exclusive = None;
            } else {
                ks.shared -= 1;
            }
            self.gc_key(k);
        }
        let run = self.run_mut(s);
        run.upgrade = None;
        run.pending_mem = false;
    }

    /// Puts a run in a terminal state and retires the oldest ended runs past the limit.
    pub(super) fn end(&mut self, s: Slot, state: RunState, ev: &mut Vec<Event>) {
        assert!(state.is_terminal());
        let was_queued = self.run(s).state == RunState::Queued;
        if !self.run(s).state.is_terminal() {
            if let Some(b) = self.runs[s as usize]
                .as_deref()
                .and_then(|r| r.req.budget.as_deref())
            {
                self.scopes.count_user(&b.scope, false, self.now);
            }
        }
        self.set_state(s, state);
        if was_queued {
            for (k, _) in self.run(s).keys.clone() {
                self.gc_key(k);
            }
        }
        ev.push(Event::Ended {
            run_id: self.run(s).req.run_id.clone(),
            state,
        });
        let p = self.run(s).project;
        self.gc_project(p);
        self.ended.push_back(s);
        // The oldest go, but none that this very `apply` ended (issue 35: the first of
        // more than `ended_retained_max` runs ended in one step were forgotten before
        // the step recorded their end, and the ledger kept them live for good).
        self.ended_in_apply += 1;
        let keep = self.cfg.ended_retained_max.max(self.ended_in_apply);
        while self.ended.len() > keep {
            let old = self.ended.pop_front().expect("non-empty");
            let run = self.runs[old as usize].take().expect("ended run");
            self.by_id.remove(&run.req.run_id);
            self.free_slots.push(old);
        }
        // The id index a deep queue grew gives its room back once it is a quarter
        // full (to a quarter more than it holds: between two rehashes at least len/4
        // runs come or go, so the rehash is amortised O(1) per run).
        if self.by_id.capacity() > 4_096 && self.by_id.capacity() > 4 * self.by_id.len() {
            self.by_id
                .shrink_to(self.by_id.len() + self.by_id.len() / 4);
        }
    }
}
