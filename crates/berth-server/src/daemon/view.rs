//! How a run is shown (its `RunInfo` and `BERTH_*` environment) and recorded (its
//! `RunRecord` for the ledger).

use super::*;

impl<H: Host> Daemon<H> {
    pub(super) fn info(&self, run_id: &str) -> Option<RunInfo> {
        let mut view = self.engine.view_of(run_id)?;
        // F1: a waiter for its fleet-wide claim says what refused it last.
        if let (Some(r), Some(why)) = (view.reason.as_mut(), self.fleet.why.get(run_id)) {
            if r.code == "fleet.claim" {
                r.message = why.clone();
            }
        }
        let extra = self.extras.get(run_id).map(|e| &**e);
        let expires_at = view.expires_at_ms.map(|t| self.host.show_time(t));
        let ws = extra
            .and_then(|e| e.workspace.as_ref())
            .map(|w| w.path.clone());
        let mut env = BTreeMap::new();
        if view.state == RunState::Granted {
            self.granted_env(&view, extra, expires_at.as_deref(), &mut env);
        }
        let ports = match (view.state, extra) {
            (RunState::Granted, Some(e)) => {
                e.ports.iter().filter(|(_, p)| *p != 0).cloned().collect()
            }
            _ => BTreeMap::new(),
        };
        let usage = self.usage_of(&view, extra);
        let roots = match (extra, &usage) {
            (Some(e), None) if e.grouped && view.state.holds_claim() => e
                .processes
                .iter()
                .map(|p| berth_proc::ProcId {
                    pid: p.pid,
                    start_ticks: p.start_ticks,
                    boot_id: p.boot_id.clone(),
                })
                .collect(),
            _ => Vec::new(),
        };
        Some(RunInfo {
            ports,
            worktree: extra.and_then(|e| e.worktree.clone()),
            labels: extra.map(|e| e.labels.clone()).unwrap_or_default(),
            workspace: ws,
            expires_at,
            deadline: view.deadline_ms.map(|t| self.host.show_time(t)),
            detached: extra.is_some_and(|e| e.detached),
            since: self.engine.since_of(run_id).map(|t| self.host.show_time(t)),
            env,
            survivors: extra.map(|e| e.survivors.clone()).unwrap_or_default(),
            failure: extra.and_then(|e| e.failure.clone()),
            owner_uid: extra.and_then(|e| e.owner_uid),
            usage,
            roots,
            limits: self.limits_of(&view, extra),
            frozen: self.frozen.runs.contains(&view.run_id),
            view,
        })
    }

    /// Issue 36: the run's use, read live from its cgroup while it holds its claim
    /// (only a run berth made a group for: a lease alone costs no read), and as its
    /// stop found it after.
    fn usage_of(&self, view: &RunView, extra: Option<&Extra>) -> Option<berth_proc::limits::Usage> {
        let e = extra?;
        match view.state.holds_claim() && e.grouped {
            // A group its stop just removed: its use as the stop found it, once told.
            true => self
                .host
                .usage(&view.run_id)
                .or(e.usage.as_deref().copied()),
            false => e.usage.as_deref().copied(),
        }
    }

    /// Issue 36: the limits a run's group is held to, where berth enforces them.
    fn limits_of(
        &self,
        view: &RunView,
        extra: Option<&Extra>,
    ) -> Option<berth_proc::limits::Limits> {
        let enforced = &self.shared.enforcement;
        (extra?.grouped && enforced.how.is_some()).then(|| {
            berth_proc::limits::plan(
                view.resources.memory,
                view.resources.cpu_millis,
                &enforced.policy,
            )
        })
    }

    /// Issue 36: what a run claimed that its cgroup is held to.
    pub(super) fn claimed(&self, run_id: &str) -> super::host::Claimed {
        self.engine
            .view_of(run_id)
            .map_or((0, 0), |v| (v.resources.memory, v.resources.cpu_millis))
    }

    /// The `BERTH_*` environment of a granted run.
    pub(super) fn granted_env(
        &self,
        view: &RunView,
        extra: Option<&Extra>,
        expires_at: Option<&str>,
        env: &mut BTreeMap<Cow<'static, str>, String>,
    ) {
        let fence = view.fence.unwrap_or(0);
        let mut put = |k: &'static str, v: String| env.insert(k.into(), v);
        put("BERTH_URL", self.shared.url.clone());
        put("BERTH_RUN_ID", view.run_id.clone());
        put("BERTH_FENCE", fence.to_string());
        put("BERTH_PROJECT", view.project.clone());
        put("BERTH_CLASS", view.class.as_str().to_string());
        put("BERTH_PRIORITY", view.priority.as_str().to_string());
        if let Some(e) = expires_at {
            put("BERTH_LEASE_EXPIRES_AT", e.to_string());
        }
        let concurrency = match view.keys.first().map(|k| k.1) {
            Some(berth_core::KeyMode::Shared) => "parallel",
            _ => "serial",
        };
        put("BERTH_CONCURRENCY", concurrency.to_string());
        if let Some(wt) = extra.and_then(|e| e.worktree.as_ref()) {
            put("BERTH_WORKTREE", wt.clone());
        }
        if let Some(ws) = extra.and_then(|e| e.workspace.as_ref()) {
            workspace::env(&ws.path, env);
        }
        // G0: a thread's run works in the thread's workspace; its tmp, out and logs
        // stay its own.
        if let Some(key) = extra.and_then(|e| e.thread.as_ref()) {
            env.insert("BERTH_THREAD".into(), key.clone());
            if let Some(tw) = self.th.ws.get(key) {
                env.insert("BERTH_WORKSPACE".into(), tw.path.clone());
            }
        }
        // W3: each port as a number and as a URL on loopback.
        for (name, port) in extra.iter().flat_map(|e| &e.ports) {
            let name = name.to_ascii_uppercase();
            env.insert(format!("BERTH_PORT_{name}").into(), port.to_string());
            env.insert(
                format!("BERTH_URL_{name}").into(),
                format!("http://127.0.0.1:{port}"),
            );
        }
    }

    pub(super) fn record(&self, run_id: &str) -> Option<RunRecord> {
        let r = self.engine.record(run_id)?;
        let extra = self.extras.get(run_id)?;
        let granted = r.fence.is_some();
        Some(RunRecord {
            request: r.request,
            worktree: extra.worktree.clone(),
            labels: extra.labels.clone(),
            state: r.state,
            fence: r.fence,
            queue_seq: extra.queue_seq,
            enqueued_ms: r.enqueued_at,
            deadline_ms: r.deadline,
            granted_ms: granted.then_some(r.granted_at),
            expires_ms: granted.then_some(r.expires_at),
            end_cause: r.cause,
            primary_mode: r.primary_mode,
            upgrading: r.upgrading,
            workspace: extra.workspace.clone(),
            processes: extra.processes.clone(),
            stop_grace_ms: extra.stop_grace_ms,
            ports: extra.ports.clone(),
            detached: extra.detached,
            thread: extra.thread.clone(),
            lease_only: extra.lease_only,
            owner_uid: extra.owner_uid,
            journal_first: extra.journal_first,
        })
    }
}
