//! The daemon simulator's other messages: every `Msg` variant the main workload does
//! not send (reads, tokens, threads, the drain, runtimes, listeners, contract changes,
//! fleet reports), each with what its answer must agree with. Together with the main
//! workload they cover every variant; `Msg::NAMES` says which exist, and the test fails
//! on one no seed sent.

use berth_core::threads::Owner;
use berth_core::{Concurrency, ContractInfo, RunState};

use super::{outcome, Sim};
use crate::auth::{Grant, Scope};
use crate::daemon::{Error, Msg, ThreadOp};
use crate::fleet::Report;

/// Thread keys the workload picks from: few, so operations meet.
const THREAD_KEYS: u64 = 3;

/// The answer's refusal code, or `ok`.
fn code<T>(res: &Result<T, Error>) -> String {
    match res {
        Ok(_) => "ok".into(),
        Err(Error::Core(e)) => e.code().to_string(),
        Err(e) => crate::error::ApiError::from(e.clone()).code,
    }
}

impl Sim {
    /// One message of the rest, picked at random.
    pub(super) fn other(&mut self) -> String {
        match self.rng.range(0, 20) {
            0 => self.get(),
            1 => self.list(),
            2 => self.status(),
            3 => self.fence_check(),
            4 => self.subscribe(),
            5 => self.create_token(),
            6 => self.revoke_token(),
            7 => self.registration_plan(),
            8 => self.reap_status(),
            9 => self.runtime_plan(),
            10 => self.runtime_ready(),
            11 => self.runtime_failed(),
            12 => self.listener_violation(),
            13 => self.thread_op(),
            14 => self.thread_list(),
            15 => self.drain_toggle(),
            16 => self.drain_get(),
            17 => self.idle(),
            18 => self.fleet_report(),
            19 => self.scope_list(),
            _ => self.contract_changed(),
        }
    }

    /// A disagreement between an answer and the daemon's state: the test fails with
    /// the trace so far.
    pub(super) fn wrong(&self, what: String) -> ! {
        panic!("{what}\ntrace:\n{}", self.trace.join("\n"))
    }

    fn state_of(&mut self, run_id: &str) -> Option<RunState> {
        self.d().engine.view_of(run_id).map(|v| v.state)
    }

    /// A run as the engine has it.
    fn get(&mut self) -> String {
        let run_id = self.pick_run();
        let want = self.state_of(&run_id);
        let id = run_id.clone();
        let res = self.ask(|reply| Msg::Get { run_id: id, reply });
        let got = res.as_ref().ok().map(|i| i.view.state);
        if got != want {
            self.wrong(format!("get {run_id}: {got:?}, the engine has {want:?}"));
        }
        format!("get {run_id} -> {}", outcome(&res))
    }

    /// Live runs (or every retained run), each as the engine has it.
    fn list(&mut self) -> String {
        let ended = self.rng.chance(0.5);
        let res = self.ask(|reply| Msg::List {
            limit: 1_000,
            ended,
            reply,
        });
        let runs = res.unwrap_or_else(|e| self.wrong(format!("list: {e:?}")));
        for r in &runs {
            let want = self.state_of(&r.view.run_id);
            if Some(r.view.state) != want || (!ended && r.view.state.is_terminal()) {
                self.wrong(format!(
                    "list: {} is {:?}, the engine has {want:?}",
                    r.view.run_id, r.view.state
                ));
            }
        }
        format!("list ended={ended} -> {} runs", runs.len())
    }

    /// The snapshot counts what the engine holds.
    fn status(&mut self) -> String {
        let res = self.ask(|reply| Msg::Status { reply });
        let (snap, _) = res.unwrap_or_else(|e| self.wrong(format!("status: {e:?}")));
        let granted = self
            .d()
            .engine
            .in_flight()
            .iter()
            .filter(|v| v.state == RunState::Granted)
            .count();
        if snap.granted != granted {
            self.wrong(format!(
                "status: {} granted, the engine has {granted}",
                snap.granted
            ));
        }
        format!(
            "status -> {granted} granted, {} queued",
            snap.queued_foreground
        )
    }

    /// L2: a fence is current exactly when its run is granted under it.
    fn fence_check(&mut self) -> String {
        let run_id = self.pick_granted();
        let fence = self.fence_of(&run_id).unwrap_or(1);
        let view = self.d().engine.view_of(&run_id);
        let want = view
            .as_ref()
            .is_some_and(|v| v.fence == Some(fence) && v.state == RunState::Granted);
        let id = run_id.clone();
        let res = self.ask(|reply| Msg::FenceCheck {
            run_id: id,
            fence,
            reply,
        });
        let (current, _) = res.unwrap_or_else(|e| self.wrong(format!("fence check: {e:?}")));
        if current != want {
            self.wrong(format!(
                "fence check {run_id} f{fence}: {current}, want {want}"
            ));
        }
        format!("fence check {run_id} f{fence} -> {current}")
    }

    /// A watch on a run starts from the run as it is.
    fn subscribe(&mut self) -> String {
        let run_id = self.pick_run();
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        self.send(Msg::Subscribe {
            run_id: run_id.clone(),
            reply: tx,
        });
        let got = rx
            .try_recv()
            .unwrap_or_else(|_| self.wrong("subscribe: no answer".into()));
        let state = got.as_ref().map(|w| w.borrow().view.state);
        let want = self.state_of(&run_id);
        if state != want {
            self.wrong(format!(
                "subscribe {run_id}: {state:?}, the engine has {want:?}"
            ));
        }
        format!("subscribe {run_id} -> {state:?}")
    }

    /// S9: a token made is checked against at once.
    fn create_token(&mut self) -> String {
        let grant = Grant {
            scope: Scope::Operator,
            uid: Some(1000 + self.rng.range(0, 1) as u32),
            expires_ms: None,
            fleet: false,
        };
        let token = self
            .ask(|reply| Msg::CreateToken { grant, reply })
            .unwrap_or_else(|e| self.wrong(format!("token: {e:?}")));
        let hash = crate::auth::hash_token(&token);
        let known = self
            .d()
            .shared
            .tokens
            .read()
            .unwrap()
            .iter()
            .any(|(h, _)| *h == hash);
        if !known {
            self.wrong(format!("token {token} made but not known"));
        }
        format!("token created {}", crate::auth::token_id(&hash))
    }

    /// S9: a token revoked is refused at once; an unknown id revokes nothing.
    fn revoke_token(&mut self) -> String {
        // A fleet token is revoked through the fleet store (`shared_turn`), as the
        // API does.
        let ids: Vec<String> = {
            let tokens = self.d().shared.tokens.read().unwrap();
            tokens
                .iter()
                .filter(|(_, g)| !g.fleet)
                .map(|(h, _)| crate::auth::token_id(h).to_string())
                .collect()
        };
        let id = match ids.is_empty() || self.rng.chance(0.2) {
            true => "0000000000000000".to_string(),
            false => ids[self.rng.range(0, ids.len() as u64 - 1) as usize].clone(),
        };
        let i = id.clone();
        let res = self.ask(|reply| Msg::RevokeToken { id: i, reply });
        let revoked = res.unwrap_or_else(|e| self.wrong(format!("revoke: {e:?}")));
        let still: bool = {
            let tokens = self.d().shared.tokens.read().unwrap();
            tokens.iter().any(|(h, _)| crate::auth::token_id(h) == id)
        };
        if still || revoked.is_some() != ids.contains(&id) {
            self.wrong(format!(
                "revoke {id}: {:?}, still known {still}",
                revoked.map(|r| r.0)
            ));
        }
        format!("token revoked {id} -> {}", revoked.is_some())
    }

    /// S3: a registration's plan names every other live run with processes, never
    /// the run itself.
    fn registration_plan(&mut self) -> String {
        let run_id = self.pick_granted();
        let fence = self.fence_of(&run_id).unwrap_or(0);
        let id = run_id.clone();
        let res = self.ask(|reply| Msg::RegistrationPlan {
            run_id: id,
            fence,
            by: None,
            reply,
        });
        if let Ok(plan) = &res {
            if plan.others.iter().any(|(id, _)| *id == run_id) {
                self.wrong(format!("registration plan of {run_id} names itself"));
            }
        }
        format!("registration plan {run_id} f{fence} -> {}", code(&res))
    }

    /// P4: how the runs of a reap are doing, one state per run known.
    fn reap_status(&mut self) -> String {
        let runs = vec![self.pick_run(), self.pick_run()];
        let r = runs.clone();
        let res = self.ask(|reply| Msg::ReapStatus { runs: r, reply });
        let (_, states, _) = res.unwrap_or_else(|e| self.wrong(format!("reap status: {e:?}")));
        format!("reap status {runs:?} -> {states:?}")
    }

    /// C7: a runtime's plan is given exactly for a run granted under that fence (the
    /// API reads the worktree's contract), with the contract it was admitted with:
    /// none, in the simulator.
    fn runtime_plan(&mut self) -> String {
        let run_id = self.pick_granted();
        let fence = self.fence_of(&run_id).unwrap_or(0);
        let granted = self
            .d()
            .engine
            .view_of(&run_id)
            .is_some_and(|v| v.fence == Some(fence) && v.state == RunState::Granted);
        let id = run_id.clone();
        let res = self.ask(|reply| Msg::RuntimePlan {
            run_id: id,
            fence,
            by: None,
            reply,
        });
        let planned = res.as_ref().ok().map(|p| p.contract.is_some());
        if planned.is_some() != granted || planned == Some(true) {
            self.wrong(format!(
                "runtime plan {run_id} f{fence} (granted {granted}): {planned:?}"
            ));
        }
        format!("runtime plan {run_id} f{fence} -> {}", code(&res))
    }

    /// C3: a ready runtime's report for a run that has none promotes nothing.
    fn runtime_ready(&mut self) -> String {
        let run_id = self.pick_granted();
        let fence = self.fence_of(&run_id).unwrap_or(0);
        let id = run_id.clone();
        let res = self.ask(|reply| Msg::RuntimeReady {
            run_id: id,
            fence,
            ports: vec!["web".into()],
            reply,
        });
        if matches!(res, Ok(true)) {
            self.wrong(format!("{run_id} promoted without a contract"));
        }
        format!("runtime ready {run_id} f{fence} -> {}", code(&res))
    }

    /// C4: a failed runtime start of a run (answered by nobody).
    fn runtime_failed(&mut self) -> String {
        let run_id = self.pick_granted();
        let fence = self.fence_of(&run_id).unwrap_or(0);
        self.send(Msg::RuntimeFailed {
            run_id: run_id.clone(),
            fence,
        });
        format!(
            "runtime failed {run_id} f{fence} -> {:?}",
            self.state_of(&run_id)
        )
    }

    /// C6: a listener in a managed run (the simulator's runs are all managed) is no
    /// violation: nothing changes.
    fn listener_violation(&mut self) -> String {
        let run_id = self.pick_granted();
        let before = self.state_of(&run_id);
        let violation = crate::listen::Violation {
            pid: 4242,
            port: 8080,
            cmdline: "sim".into(),
        };
        self.send(Msg::ListenerViolation {
            run_id: run_id.clone(),
            violation,
        });
        let after = self.state_of(&run_id);
        if before != after {
            self.wrong(format!(
                "a listener changed managed run {run_id}: {before:?} -> {after:?}"
            ));
        }
        format!("listener in {run_id} -> {after:?}")
    }

    /// G0–G3: attach, move the deadline, detach, look at or evict a thread, with an
    /// owner that may be stale.
    fn thread_op(&mut self) -> String {
        let key = format!("t{}", self.rng.range(0, THREAD_KEYS - 1));
        let owner = Owner {
            gen: format!("g{}", self.rng.range(0, 1)),
            fence: self.rng.range(1, 3),
            run_id: self.pick_run(),
        };
        let budget_ms = self.rng.range(1, 120) * 1_000;
        let op = match self.rng.range(0, 4) {
            0 => ThreadOp::Attach {
                key: key.clone(),
                owner,
                budget_ms,
            },
            1 => ThreadOp::Deadline {
                key: key.clone(),
                owner,
                budget_ms,
            },
            2 => {
                let evict = self.rng.chance(0.5);
                ThreadOp::Detach {
                    key: key.clone(),
                    owner,
                    evict,
                }
            }
            3 => ThreadOp::Get { key: key.clone() },
            _ => ThreadOp::Evict { key: key.clone() },
        };
        let what = format!("thread {op:?}");
        let res = self.ask(|reply| Msg::Thread {
            op,
            by: None,
            reply,
        });
        format!("{what} -> {}", code(&res))
    }

    /// Every thread the daemon remembers, once each.
    fn thread_list(&mut self) -> String {
        let res = self.ask(|reply| Msg::ThreadList { reply });
        let list = res.unwrap_or_else(|e| self.wrong(format!("threads: {e:?}")));
        let mut keys: Vec<&str> = list.iter().map(|t| t.key.as_str()).collect();
        keys.sort_unstable();
        keys.dedup();
        if keys.len() != list.len() {
            self.wrong(format!("threads listed twice: {keys:?}"));
        }
        format!("threads -> {keys:?}")
    }

    /// G4: a drain starts now and then, and the next toggle ends it.
    fn drain_toggle(&mut self) -> String {
        let draining = self.d().th.drain.is_some();
        if !draining && !self.rng.chance(0.3) {
            return self.drain_get();
        }
        let start = (!draining).then(|| ("sim".to_string(), "sim".to_string()));
        let res = self.ask(|reply| Msg::Drain { start, reply });
        let d = res.unwrap_or_else(|e| self.wrong(format!("drain: {e:?}")));
        // The engine drains while the host's drain or the fleet's is in force.
        let fleet = self.d().th.fleet_drain.is_some();
        let engine = self.d().engine.is_draining();
        if d.drain.is_some() == draining || engine != (d.drain.is_some() || fleet) {
            self.wrong(format!(
                "drain toggled from {draining}: {:?}, fleet drain {fleet}, engine {engine}",
                d.drain
            ));
        }
        format!(
            "drain {} -> {} in flight",
            if draining { "ended" } else { "started" },
            d.waiting_for.len()
        )
    }

    fn drain_get(&mut self) -> String {
        let res = self.ask(|reply| Msg::DrainGet { reply });
        let d = res.unwrap_or_else(|e| self.wrong(format!("drain: {e:?}")));
        let draining = self.d().engine.is_draining();
        let shown = d.drain.is_some() || d.fleet_drain.is_some();
        if shown != draining || d.draining != draining {
            self.wrong(format!(
                "drain shown as {:?} and {:?}, the engine drains: {draining}",
                d.drain, d.fleet_drain
            ));
        }
        format!("drain? -> {}", d.drain.is_some())
    }

    fn idle(&mut self) -> String {
        let res = self.ask(|reply| Msg::Idle { reply });
        let idle = res.unwrap_or_else(|e| self.wrong(format!("idle: {e:?}")));
        format!("idle -> {}", idle.idle)
    }

    /// F1–F3 reports reach a daemon not in fleet mode too (a late report after a
    /// restart): they change nothing it has.
    fn fleet_report(&mut self) -> String {
        // In a fleet seed the reports are the link's own (`sim/fleet.rs`).
        if self.fleet.is_some() {
            return self.fleet_step();
        }
        let before = super::runs(self.d());
        let report = match self.rng.range(0, 2) {
            0 => Report::Wake {
                payloads: vec!["key sim".into()],
            },
            1 => Report::Status {
                available: self.rng.chance(0.5),
                gen: self.rng.range(0, 2) as i64,
                beat_ok_ms: self.now,
            },
            _ => Report::Declared {
                host_id: "other".into(),
                gen: 1,
            },
        };
        let what = format!("fleet {report:?}");
        self.send(Msg::Fleet(report));
        if super::runs(self.d()) != before {
            self.wrong(format!(
                "{what} changed the runs of a host not in fleet mode"
            ));
        }
        what
    }

    fn scope_list(&mut self) -> String {
        let res = self.ask(|reply| Msg::ScopeList { reply });
        let scopes = res.unwrap_or_else(|e| self.wrong(format!("scopes: {e:?}")));
        format!("scopes -> {}", scopes.len())
    }

    /// C4: the worktree's contract changed under a run (here: it never had one).
    fn contract_changed(&mut self) -> String {
        let run_id = self.pick_granted();
        let fence = self.fence_of(&run_id).unwrap_or(0);
        let contract = ContractInfo {
            concurrency: Concurrency::Parallel,
            fingerprint: "sim".into(),
            commit: None,
        };
        let id = run_id.clone();
        let res = self.ask(|reply| Msg::ContractChanged {
            run_id: id,
            fence,
            contract,
            reply,
        });
        format!("contract changed {run_id} f{fence} -> {}", outcome(&res))
    }
}
