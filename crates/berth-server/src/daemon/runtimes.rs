//! The daemon's side of starting a run's runtime (C7): what a start needs, and what
//! its outcome means for the project (promotion, C3; invalidation and demotion, C4).
//! Launching and probing happen outside the daemon (`crate::runtime`), which reports
//! back with these messages.

use std::collections::BTreeSet;
use std::path::PathBuf;

use berth_core::{Class, Command, ContractInfo, Error as CoreError, RunState};

use super::{Daemon, Error, Host, Reply, RunInfo};

/// What starting a granted run's runtime needs.
#[derive(Clone, Debug)]
pub struct RuntimePlan {
    pub info: RunInfo,
    /// The contract the run was admitted with (its fingerprint and commit).
    pub contract: Option<ContractInfo>,
    /// The run's cgroup's `cgroup.procs` files (cgroup2's first, then any v1
    /// hierarchy's), made ready: a launched process moves itself into each before it
    /// executes anything (so even a double fork stays in the group). Empty: no group.
    pub group_procs: Vec<PathBuf>,
}

impl<H: Host> Daemon<H> {
    /// The run must be granted with this fence and managed (C6: analysis runs may not
    /// listen); its worktree's contract is read by the API, not here.
    fn runtime_run(&self, run_id: &str, fence: u64) -> Result<RunInfo, Error> {
        let view = self.granted_view(run_id, fence)?;
        if view.class != Class::Managed {
            return Err(CoreError::NotEligible {
                run_id: run_id.to_string(),
                why: "an analysis run may not start a runtime: it may not listen (C6)".into(),
            }
            .into());
        }
        self.info(run_id).ok_or_else(Error::run_vanished)
    }

    pub(super) fn on_runtime_plan(
        &mut self,
        run_id: String,
        fence: u64,
        by: super::Tenant,
        reply: Reply<RuntimePlan>,
    ) {
        // S9: only the run's owner (or a token of full reach) starts its runtime.
        if let Err(e) = self.check_run_owner(&run_id, by) {
            return self.commit_and_answer(std::collections::BTreeSet::new(), reply, Err(e));
        }
        let plan = self.runtime_run(&run_id, fence).map(|info| RuntimePlan {
            contract: self.engine.record(&run_id).and_then(|r| r.request.contract),
            group_procs: self.host.prepare_group(&run_id, self.claimed(&run_id)),
            info,
        });
        self.answer(reply, plan);
    }

    /// C3: every port answered. A parallel-eligible run proves its project; any other
    /// (a serial contract, a background run) simply has its runtime up.
    pub(super) fn on_runtime_ready(
        &mut self,
        run_id: String,
        fence: u64,
        ports: Vec<String>,
        reply: Reply<bool>,
    ) {
        let mut touched = BTreeSet::new();
        let cmd = Command::Promote {
            run_id,
            fence,
            ports,
        };
        let value = match self.apply(cmd, &mut touched) {
            Ok(_) => Ok(true),
            Err(CoreError::NotEligible { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        };
        self.commit_and_answer(touched, reply, value);
    }

    /// C4: a failed start by a run riding the evidence invalidates it.
    pub(super) fn on_runtime_failed(&mut self, run_id: String, fence: u64) {
        let mut touched = BTreeSet::new();
        let _ = self.apply(Command::RuntimeFailed { run_id, fence }, &mut touched);
        self.commit(touched, |_| {});
    }

    /// C6: an analysis run opened a listener: it is stopped, and says why. Only a run
    /// under watch now is: a report that arrives late (the run ended, and its id is a
    /// new run's, perhaps a managed one that may listen) stops nothing. (The daemon
    /// simulator found a managed run released by such a report.)
    pub(super) fn on_listener_violation(&mut self, run_id: String, v: crate::listen::Violation) {
        if !self.listen_watched.contains_key(&run_id)
            || self.engine.class_of(&run_id) != Some(berth_core::Class::Analysis)
        {
            tracing::debug!(run_id, "listener report for a run not under watch: ignored");
            return;
        }
        let Some(fence) = self
            .engine
            .view_of(&run_id)
            .filter(|v| v.state == RunState::Granted)
            .and_then(|v| v.fence)
        else {
            return;
        };
        let why = format!(
            "analysis_listener_violation: pid {} ({}) listened on port {}; an analysis run may not listen (C6)",
            v.pid, v.cmdline, v.port
        );
        tracing::warn!(
            run_id = run_id.as_str(),
            pid = v.pid,
            port = v.port,
            cmdline = v.cmdline.as_str(),
            "analysis run stopped: it opened a listener"
        );
        if let Some(e) = self.extras.get_mut(&run_id) {
            e.failure = Some(why);
        }
        let mut touched = BTreeSet::new();
        let _ = self.apply(Command::Release { run_id, fence }, &mut touched);
        self.commit(touched, |_| {});
    }

    /// C4: the worktree moved on under the run: it queues for the runtime key alone
    /// before giving up a shared hold, and stale evidence is invalidated.
    pub(super) fn on_contract_changed(
        &mut self,
        run_id: String,
        fence: u64,
        contract: ContractInfo,
        reply: Reply<RunInfo>,
    ) {
        let mut touched = BTreeSet::new();
        let cmd = Command::Demote {
            run_id: run_id.clone(),
            fence,
            fingerprint: contract.fingerprint,
            commit: contract.commit,
        };
        let value = self
            .apply(cmd, &mut touched)
            .map_err(Error::from)
            .and_then(|_| self.info(&run_id).ok_or_else(Error::run_vanished));
        self.commit_and_answer(touched, reply, value);
    }
}
