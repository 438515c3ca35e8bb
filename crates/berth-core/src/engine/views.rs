//! Read-only views of the engine: a run's position, reason and view, and the
//! queries the server answers from (in flight, queued, head, fleet needs).

use super::*;

impl Engine {
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn last_fence(&self) -> Fence {
        self.last_fence
    }

    pub fn now(&self) -> TimeMs {
        self.now
    }

    /// B1–B6: every scope and its tokens.
    pub fn scopes(&self) -> &Scopes {
        &self.scopes
    }

    /// G4: whether the host is draining.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    pub fn queue_len(&self) -> usize {
        self.queues[0].len() + self.queues[1].len()
    }

    /// 1-based position in the host queue: every foreground waiter comes first.
    pub(crate) fn position(&self, s: Slot) -> u64 {
        let r = self.run(s);
        let band = r.req.priority.index();
        let before = if band == 1 {
            self.queues[0].len() as u64
        } else {
            0
        };
        before + self.queues[band].rank(r.seq) + 1
    }

    /// A11: the reason a queued run is waiting, as a code and a sentence.
    pub(crate) fn reason(&self, s: Slot) -> Reason {
        let run = self.run(s);
        let band = run.req.priority.index();
        let head = self.queues[band].head().map(|(_, h)| h);
        let is_head = head == Some(s);
        let blocker = self.blocker(s, is_head).or_else(|| match head {
            Some(h) if !is_head && self.guard_active(h) && !self.head_fits_after(h, s) => {
                Some(Blocker::Guard { head: h })
            }
            _ => None,
        });
        match blocker {
            Some(b) => self.render_blocker(b),
            // Nothing blocks it, yet no pass has granted it. A later waiter waits for the
            // rotating window (A6), which may take several passes: no promise of which.
            None if is_head => Reason {
                code: "queue.scan".into(),
                message: "fits now; the next admission pass offers it the first pick".into(),
            },
            None => Reason {
                code: "queue.scan".into(),
                message: format!(
                    "fits now; waits for the rotating scan window ({} waiters per pass) to reach it",
                    self.cfg.window
                ),
            },
        }
    }

    pub(crate) fn describe_key(&self, k: KeyId) -> String {
        let name = &self.key(k).name;
        if let Some(s) = name.strip_prefix("singleton:") {
            format!("singleton {s}")
        } else if let Some(p) = name.strip_prefix("project:") {
            let (proj, kind) = p.rsplit_once(':').unwrap_or((p, ""));
            format!("project {proj} {kind} key")
        } else {
            name.clone()
        }
    }

    pub(crate) fn view(&self, s: Slot) -> RunView {
        let r = self.run(s);
        let queued = r.state == RunState::Queued;
        let held = r.state.holds_claim();
        RunView {
            run_id: r.req.run_id.clone(),
            project: r.req.project.clone(),
            class: r.req.class,
            priority: r.req.priority,
            state: r.state,
            fence: r.fence,
            expires_at_ms: held.then_some(r.expires_at),
            ttl_ms: held.then_some(r.req.ttl_ms),
            cause: r.cause,
            deadline_ms: queued.then_some(r.deadline),
            position: queued.then(|| self.position(s)),
            reason: if queued {
                Some(self.reason(s))
            } else {
                r.last_reason.as_deref().cloned()
            },
            keys: key_names(&r.req)
                .into_iter()
                .zip(r.keys.iter().map(|&(_, m)| m))
                .collect(),
            resources: r.req.resources.clone(),
        }
    }

    /// What the ledger must remember about a run (the inverse of [`Engine::restore`]).
    pub fn record(&self, run_id: &str) -> Option<RestoredRun> {
        let r = self.run(*self.by_id.get(run_id)?);
        Some(RestoredRun {
            request: r.req.clone(),
            state: r.state,
            fence: r.fence,
            enqueued_at: r.enqueued_at,
            deadline: r.deadline,
            granted_at: r.granted_at,
            expires_at: r.expires_at,
            cause: r.cause,
            primary_mode: r.keys[0].1,
            upgrading: r.upgrade.is_some(),
        })
    }

    /// The run's class, if berth still remembers the run (cheap: no view is built).
    pub fn class_of(&self, run_id: &str) -> Option<Class> {
        Some(self.run(*self.by_id.get(run_id)?).req.class)
    }

    /// The run's project, if berth still remembers the run (cheap: no view is built).
    pub fn project_of(&self, run_id: &str) -> Option<&str> {
        let s = *self.by_id.get(run_id)?;
        Some(self.run(s).req.project.as_str())
    }

    /// Why the run waits, if it is queued (no view is built: a run granted in the step
    /// that queued it, the common case, costs a lookup).
    pub fn reason_of(&self, run_id: &str) -> Option<Reason> {
        let s = *self.by_id.get(run_id)?;
        (self.run(s).state == RunState::Queued).then(|| self.reason(s))
    }

    /// The run's budget, if it has one (cheap: nothing is cloned).
    pub fn budget_of(&self, run_id: &str) -> Option<&crate::scopes::Budget> {
        self.run(*self.by_id.get(run_id)?).req.budget.as_deref()
    }

    /// F1: what a run needs of the fleet besides its id and fence: its budget token
    /// (scope, harness and the harness's limit as the scope froze it) and its
    /// fleet-wide singletons (named `fleet:NAME`; the key is NAME).
    pub fn fleet_needs(&self, run_id: &str) -> Option<FleetNeeds> {
        let run = self.run(*self.by_id.get(run_id)?);
        let token = run.req.budget.as_deref().and_then(|b| {
            let limit = *self.scopes.get(&b.scope)?.policy.get(&b.harness)?;
            Some((b.scope.clone(), b.harness.clone(), limit))
        });
        let keys = run
            .req
            .singletons
            .iter()
            .filter_map(|s| s.strip_prefix(FLEET_SINGLETON_PREFIX))
            .map(str::to_owned)
            .collect();
        Some(FleetNeeds {
            token,
            keys,
            state: run.state,
        })
    }

    /// The run's fence, if it was ever granted (cheap: no view is built).
    pub fn fence_of(&self, run_id: &str) -> Option<u64> {
        self.run(*self.by_id.get(run_id)?).fence
    }

    /// The run's current view, if berth still remembers it.
    pub fn view_of(&self, run_id: &str) -> Option<RunView> {
        self.by_id.get(run_id).map(|&s| self.view(s))
    }

    /// Since when the run holds its state's start: its grant once granted, else when
    /// it queued (what `berth runs` shows as its age).
    pub fn since_of(&self, run_id: &str) -> Option<TimeMs> {
        let r = self.run(*self.by_id.get(run_id)?);
        Some(if r.fence.is_some() {
            r.granted_at
        } else {
            r.enqueued_at
        })
    }

    /// The head of the host queue (foreground first): id, priority, when it queued.
    pub fn head(&self) -> Option<(&str, Priority, TimeMs)> {
        let (_, s) = self.queues[0].head().or_else(|| self.queues[1].head())?;
        let r = self.run(s);
        Some((&r.req.run_id, r.req.priority, r.enqueued_at))
    }

    /// G4: the runs in flight (granted, releasing or degraded: a run is in flight until
    /// its processes are stopped and its workspace is cleaned), in run id order.
    pub fn in_flight(&self) -> Vec<RunView> {
        let mut out: Vec<RunView> = self
            .runs
            .iter()
            .enumerate()
            .filter(|(_, r)| {
                r.as_ref().is_some_and(|r| {
                    matches!(
                        r.state,
                        RunState::Granted | RunState::Releasing | RunState::Degraded
                    )
                })
            })
            .map(|(s, _)| self.view(s as Slot))
            .collect();
        out.sort_by(|a, b| a.run_id.cmp(&b.run_id));
        out
    }

    /// Waiters in admission order (foreground first), at most `limit` of them.
    pub fn queued(&self, limit: usize) -> Vec<RunView> {
        self.queues[0]
            .iter()
            .chain(self.queues[1].iter())
            .take(limit)
            .map(|(_, s)| self.view(s))
            .collect()
    }
}
