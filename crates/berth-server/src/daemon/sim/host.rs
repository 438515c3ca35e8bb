//! The simulated machine under the daemon: workspaces, registered processes and stop
//! orders in memory, failing workspace creation and removal when told to.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use berth_proc::ProcId;
use berth_store::WorkspaceIdentity;

use super::super::{Host, StopOrder, StopSink};
use crate::register::{OtherRun, Refusal};

/// The machine under the daemon, shared with the simulator so that it outlives a
/// restart of the daemon and can be looked at.
#[derive(Default)]
pub(super) struct Machine {
    pub(super) workspaces: BTreeMap<String, WorkspaceIdentity>,
    pub(super) next_ino: u64,
    /// Living registered processes: pid → the run that started it.
    pub(super) alive: BTreeMap<i32, String>,
    pub(super) next_pid: i32,
    /// Stop orders handed over (after their commit), not yet carried out.
    pub(super) orders: Vec<StopOrder>,
    pub(super) fail_create: bool,
    pub(super) fail_remove: bool,
    pub(super) tokens: u64,
}

/// How long an injected failure lasts, in steps: long enough for retries to meet it.
pub(super) const FAILURE_STEPS_MAX: u64 = 25;

pub(super) struct SimHost(pub(super) Arc<Mutex<Machine>>);

impl Host for SimHost {
    fn create_workspace(&mut self, run_id: &str, _owner: Option<u32>) -> crate::daemon::host::Made {
        let mut m = self.0.lock().unwrap();
        if m.fail_create {
            return Err("sim: no space left on device".into());
        }
        m.next_ino += 1;
        let ws = WorkspaceIdentity {
            path: format!("/sim/runs/{run_id}"),
            dev: 1,
            ino: m.next_ino,
        };
        let old = m.workspaces.insert(run_id.to_string(), ws.clone());
        assert!(old.is_none(), "{run_id}: a second workspace over {old:?}");
        Ok(ws)
    }

    fn remove_workspace(&mut self, ws: &WorkspaceIdentity, run_id: &str) -> Result<(), String> {
        let mut m = self.0.lock().unwrap();
        if m.fail_remove {
            return Err("sim: device busy".into());
        }
        // By where it is, as the real host finds it (`run_id` only names its logs).
        let at = m.workspaces.iter().find(|(_, w)| w.path == ws.path);
        match at.map(|(k, w)| (k.clone(), w.clone())) {
            None => Ok(()),
            Some((_, have)) if have != *ws => Err(format!("sim: {run_id} swapped")),
            Some((k, _)) => {
                m.workspaces.remove(&k);
                Ok(())
            }
        }
    }

    fn sweep_workspaces(
        &mut self,
        owned: &crate::daemon::host::Owned,
        ended: &crate::daemon::host::Ended,
    ) -> Vec<(String, Option<String>)> {
        let mut m = self.0.lock().unwrap();
        let swept: Vec<String> = (m.workspaces.iter())
            .filter(|(_, w)| !owned.contains(&(w.path.clone(), w.dev, w.ino)))
            .map(|(k, _)| k.clone())
            .collect();
        swept
            .into_iter()
            .filter_map(|k| m.workspaces.remove(&k))
            .map(|w| {
                let run = ended.get(&(w.path.clone(), w.dev, w.ino)).cloned();
                (w.path, run)
            })
            .collect()
    }

    fn workspace_present(&self, ws: &WorkspaceIdentity) -> bool {
        self.0.lock().unwrap().workspaces.values().any(|w| w == ws)
    }

    fn has_group(&self, _run_id: &str) -> bool {
        false
    }

    fn stop_sink(&mut self) -> StopSink {
        let m = self.0.clone();
        Arc::new(move |o| m.lock().unwrap().orders.push(o))
    }

    fn check_process(
        &self,
        _uid: u32,
        pid: i32,
        others: &[OtherRun<'_>],
    ) -> Result<ProcId, Refusal> {
        if pid <= 1 {
            return Err(Refusal::Forbidden(format!("pid {pid} is init")));
        }
        if !self.0.lock().unwrap().alive.contains_key(&pid) {
            return Err(Refusal::NoSuchProcess);
        }
        if let Some(o) = others.iter().find(|o| o.roots.iter().any(|r| r.pid == pid)) {
            return Err(Refusal::OwnedByRun {
                run_id: o.run_id.to_string(),
            });
        }
        Ok(ProcId {
            pid,
            start_ticks: 1,
            boot_id: "sim".into(),
        })
    }

    fn port_in_use(&self, _port: u16) -> bool {
        false
    }

    fn adopt(&mut self, _run_id: &str, _pid: i32, _claim: crate::daemon::Claimed) {}

    fn prepare_group(
        &mut self,
        _run_id: &str,
        _claim: crate::daemon::Claimed,
    ) -> Vec<std::path::PathBuf> {
        Vec::new()
    }

    fn usage(&self, _run_id: &str) -> Option<berth_proc::limits::Usage> {
        None
    }

    fn freeze(&mut self, _run_id: &str, _frozen: bool) -> Result<(), String> {
        Err("the simulated host has no cgroups".into())
    }

    fn listeners_of(&self, _roots: &[ProcId]) -> std::collections::BTreeSet<u64> {
        Default::default()
    }

    fn listening_now(&self) -> std::collections::BTreeSet<u64> {
        Default::default()
    }

    fn watch_listeners(&mut self, _watched: Vec<crate::daemon::ListenWatch>) {}

    fn cover_fence(&mut self, _last_fence: u64) -> Result<(), String> {
        Ok(())
    }

    fn new_token(&mut self) -> Result<String, String> {
        let mut m = self.0.lock().unwrap();
        m.tokens += 1;
        Ok(format!("sim-token-{}", m.tokens))
    }

    fn diagnostics(&self) -> (u64, u64) {
        (0, 0)
    }

    fn show_time(&self, mono_ms: u64) -> String {
        format!("t+{mono_ms}")
    }

    fn release_memory(&mut self) {}

    fn disk_free(&self) -> Option<u64> {
        None
    }

    fn close(&mut self, _clean_last_fence: Option<u64>) {}
}
