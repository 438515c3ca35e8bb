//! P1/S3/C6: registering a run's processes (the rule checked here or off the state
//! task) and watching analysis runs for listeners.

use super::*;

impl<H: Host> Daemon<H> {
    /// The run, granted under exactly this fence (L2), or the refusal that says why not.
    pub(super) fn granted_view(&self, run_id: &str, fence: u64) -> Result<RunView, Error> {
        let view = self
            .engine
            .view_of(run_id)
            .ok_or_else(|| CoreError::NotFound {
                run_id: run_id.to_string(),
            })?;
        if view.fence != Some(fence) {
            return Err(CoreError::StaleFence {
                run_id: run_id.to_string(),
                given: Some(fence),
                current: view.fence,
            }
            .into());
        }
        if view.state != RunState::Granted {
            return Err(CoreError::Gone {
                run_id: run_id.to_string(),
                state: view.state,
            }
            .into());
        }
        Ok(view)
    }

    /// P1: records a process of a granted run by identity, and moves it into the
    /// run's cgroup where the host allows one.
    pub(super) fn register(
        &mut self,
        run_id: &str,
        fence: u64,
        (pid, uid): (i32, u32),
        checked: Option<(berth_proc::ProcId, u64)>,
    ) -> Result<RunInfo, Error> {
        let view = self.granted_view(run_id, fence)?;
        // S3: the registration rule (crate::register), against every other live run
        // with processes, in run id order: checked off this task when no registration
        // came between its plan and now, else here.
        let id = match checked {
            Some((id, generation)) if generation == self.registrations && id.pid == pid => id,
            _ => {
                let plan = self.registration_others(run_id);
                let others: Vec<crate::register::OtherRun<'_>> = plan
                    .iter()
                    .map(|(id, roots)| crate::register::OtherRun {
                        run_id: id,
                        roots: roots.clone(),
                    })
                    .collect();
                self.host
                    .check_process(uid, pid, &others)
                    .map_err(|refusal| Error::Registration { pid, refusal })?
            }
        };
        self.registrations += 1;
        let claim = self.claimed(run_id);
        self.host.adopt(run_id, pid, claim);
        let rec = berth_store::ProcessRecord {
            pid: id.pid,
            start_ticks: id.start_ticks,
            boot_id: id.boot_id,
        };
        if let Some(e) = self.extras.get_mut(run_id) {
            if !e.processes.contains(&rec) {
                e.processes.push(rec);
            }
            e.grouped = true;
        }
        if let Some(f) = view.fence {
            // Bounded: one entry per registration, drained at the next sample.
            if self.to_settle.len() < super::TO_SETTLE_MAX
                && !self.to_settle.iter().any(|(r, _)| r == run_id)
            {
                self.to_settle.push((run_id.to_string(), f));
            }
        }
        if view.class == berth_core::Class::Analysis {
            self.watch_analysis_run(run_id);
        }
        self.info(run_id).ok_or_else(Error::run_vanished)
    }

    /// Every other live run with processes and its roots, in run id order.
    pub(super) fn registration_others(
        &self,
        run_id: &str,
    ) -> Vec<(String, Vec<berth_proc::ProcId>)> {
        let mut others: Vec<(String, Vec<berth_proc::ProcId>)> = self
            .extras
            .iter()
            .filter(|(id, e)| {
                id.as_str() != run_id
                    && !e.processes.is_empty()
                    && self
                        .engine
                        .view_of(id)
                        .is_some_and(|v| !v.state.is_terminal())
            })
            .map(|(id, e)| (id.clone(), e.processes.iter().map(proc_id).collect()))
            .collect();
        others.sort_by(|a, b| a.0.cmp(&b.0));
        others
    }

    /// S3: a registration's plan, for its check off the state task.
    pub(super) fn on_registration_plan(
        &mut self,
        run_id: String,
        fence: u64,
        by: Tenant,
        reply: Reply<RegistrationPlan>,
    ) {
        let plan = self
            .check_run_owner(&run_id, by)
            .and_then(|()| self.granted_view(&run_id, fence))
            .map(|_| RegistrationPlan {
                others: self.registration_others(&run_id),
                generation: self.registrations,
            });
        self.answer(reply, plan);
    }

    /// C6: an analysis run with processes is watched for listeners; what its processes
    /// hold when registered is its baseline.
    pub(super) fn watch_analysis_run(&mut self, run_id: &str) {
        let roots: Vec<berth_proc::ProcId> = self
            .extras
            .get(run_id)
            .map(|e| e.processes.iter().map(proc_id).collect())
            .unwrap_or_default();
        let mut now = self.host.listeners_of(&roots);
        // Only what the host already had at the grant is tolerated: a listener opened
        // before the registration is the run's own (issue 32 concern).
        if let Some(at_grant) = self
            .extras
            .get(run_id)
            .and_then(|e| e.listeners_at_grant.as_deref())
        {
            now.retain(|inode| at_grant.binary_search(inode).is_ok());
        }
        self.listen_watched
            .entry(run_id.to_string())
            .or_default()
            .extend(now);
        self.send_listen_watch();
    }

    /// C6: an analysis run's grant notes the host's listeners (its baseline's bound).
    pub(super) fn note_listeners_at_grant(&mut self, run_id: &str) {
        if self.engine.class_of(run_id) == Some(berth_core::Class::Analysis) {
            let now = self.host.listening_now();
            if let Some(e) = self.extras.get_mut(run_id) {
                e.listeners_at_grant = Some(now.into_iter().collect());
            }
        }
    }

    pub(super) fn send_listen_watch(&mut self) {
        let watched = self
            .listen_watched
            .iter()
            .map(|(id, baseline)| ListenWatch {
                run_id: id.clone(),
                roots: self
                    .extras
                    .get(id)
                    .map(|e| e.processes.iter().map(proc_id).collect())
                    .unwrap_or_default(),
                baseline: baseline.clone(),
            })
            .collect();
        self.host.watch_listeners(watched);
    }
}
