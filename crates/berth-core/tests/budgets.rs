//! B2/B3 at the engine level, as a property: random acquires with budgets, releases,
//! lease expiries, turn reservations, owner releases, reconciliations, scope control and
//! restarts (an engine rebuilt from its own records and scopes) never put a harness
//! over its limit, and never free a token by time. A reference count of the tokens
//! (`held`, moved only by the events the rules allow) must equal the engine's at every
//! step: a token that vanished without its owner's release or a reconciliation, or
//! appeared without a grant or a reservation, fails the property.

use std::collections::BTreeMap;

use berth_core::scopes::{Budget, Mode, Policy, Scope};
use berth_core::*;
use proptest::prelude::*;

const HARNESSES: [&str; 3] = ["claude", "codex", "gemini"];

fn policy() -> Policy {
    [("claude", 1), ("codex", 2), ("gemini", 3)]
        .iter()
        .map(|(h, n)| (h.to_string(), *n))
        .collect()
}

#[derive(Clone, Debug)]
enum Op {
    Acquire { run: u8, harness: u8, ttl_s: u8 },
    Release { run: u8 },
    StopDone { run: u8 },
    Tick { advance_s: u8 },
    Reserve { owner: u8, harness: u8 },
    Unreserve { owner: u8 },
    Reconcile { owner: u8 },
    Control { id: u8, mode: u8 },
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u8..24, 0u8..3, 1u8..30).prop_map(|(run, harness, ttl_s)| Op::Acquire { run, harness, ttl_s }),
        3 => (0u8..24).prop_map(|run| Op::Release { run }),
        3 => (0u8..24).prop_map(|run| Op::StopDone { run }),
        2 => (0u8..20).prop_map(|advance_s| Op::Tick { advance_s }),
        // Owners 6.. are run ids with the run's own operation: a turn must never take
        // a live run's key (a regression: a waiter granted with its key held by a
        // turn of another harness brought the daemon down).
        2 => (0u8..30, 0u8..3).prop_map(|(owner, harness)| Op::Reserve { owner, harness }),
        1 => (0u8..6).prop_map(|owner| Op::Unreserve { owner }),
        1 => (0u8..30).prop_map(|owner| Op::Reconcile { owner }),
        1 => (0u8..4, 0u8..3).prop_map(|(id, mode)| Op::Control { id, mode }),
        1 => Just(Op::Restart),
    ]
}

fn request(run: u8, harness: u8, ttl_s: u8) -> Request {
    Request {
        run_id: format!("r{run}"),
        project: format!("p{run}"),
        class: Class::Managed,
        priority: Priority::Foreground,
        resources: Resources {
            slots: 1,
            ..Resources::default()
        },
        singletons: vec![],
        contract: None,
        ttl_ms: u64::from(ttl_s) * 1000,
        wait_ms: 120_000,
        budget: Some(Box::new(Budget {
            scope: "x".into(),
            harness: HARNESSES[harness as usize].into(),
            operation_id: None,
            per_harness: Some(policy()),
            manifest: None,
            tenant: None,
        })),
    }
}

/// The engine's tokens as (owner, operation) -> harness.
fn tokens(e: &Engine) -> BTreeMap<(String, String), String> {
    e.scopes().get("x").map_or_else(BTreeMap::new, |s| {
        s.tokens
            .iter()
            .map(|(k, t)| (k.clone(), t.harness.clone()))
            .collect()
    })
}

fn restart(e: &Engine, cfg: &Config, now: u64) -> Engine {
    let mut runs: Vec<RestoredRun> = (0..24).filter_map(|i| e.record(&format!("r{i}"))).collect();
    // The ledger gives runs back in arrival order.
    runs.sort_by_key(|r| (r.enqueued_at, r.request.run_id.clone()));
    let scopes: Vec<Scope> = e.scopes().iter().cloned().collect();
    Engine::restore_with_scopes(
        cfg.clone(),
        e.last_fence(),
        now,
        runs,
        scopes,
        Vec::new(),
        false,
    )
    .expect("an engine restores from its own records")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn limits_hold_and_only_their_owner_or_an_operator_frees_a_token(
        ops in proptest::collection::vec(op(), 1..150),
    ) {
        let mut cfg = Config::for_host(8, 16 * GIB, 0);
        cfg.slots_max = 16;
        cfg.memory_reserve = 0;
        cfg.disk_reserve = 0;
        cfg.default_request = Resources { slots: 1, ..Resources::default() };
        let mut e = Engine::new(cfg.clone(), 0).unwrap();
        // The reference: the tokens as only the allowed events move them.
        let mut held: BTreeMap<(String, String), String> = BTreeMap::new();
        let mut now = 0u64;
        for o in ops {
            let cmd = match o {
                Op::Acquire { run, harness, ttl_s } => Command::Acquire(request(run, harness, ttl_s)),
                Op::Release { run } => {
                    let id = format!("r{run}");
                    match e.fence_of(&id) {
                        Some(fence) => Command::Release { run_id: id, fence },
                        None => Command::Cancel { run_id: id },
                    }
                }
                Op::StopDone { run } => Command::StopDone { run_id: format!("r{run}"), ok: true },
                Op::Tick { advance_s } => {
                    now += u64::from(advance_s) * 1000;
                    Command::Tick
                }
                Op::Reserve { owner, harness } => Command::Reserve {
                    scope: "x".into(),
                    owner: if owner < 6 { format!("w{owner}") } else { format!("r{}", owner - 6) },
                    operation_id: if owner < 6 { "turn" } else { "run" }.into(),
                    harness: HARNESSES[harness as usize].into(),
                },
                Op::Unreserve { owner } => Command::Unreserve {
                    scope: "x".into(),
                    owner: format!("w{owner}"),
                    operation_id: "turn".into(),
                },
                Op::Reconcile { owner } => Command::Reconcile {
                    scope: "x".into(),
                    owner: if owner < 24 { format!("r{owner}") } else { format!("w{}", owner - 24) },
                },
                Op::Control { id, mode } => Command::ScopeControl {
                    scope: "x".into(),
                    request_id: format!("q{id}"),
                    mode: [Mode::Pause, Mode::Resume, Mode::Stop][mode as usize],
                },
                Op::Restart => {
                    e = restart(&e, &cfg, now);
                    prop_assert_eq!(&tokens(&e), &held, "a restart changed the tokens");
                    continue;
                }
            };
            let is_tick = matches!(cmd, Command::Tick);
            let by_request = matches!(cmd, Command::Unreserve { .. } | Command::Reconcile { .. });
            let out = e.apply(now, cmd);
            // A run's own token comes back only when the run ended `released`.
            let released: Vec<&str> = out
                .events
                .iter()
                .filter_map(|ev| match ev {
                    Event::Ended { run_id, state: RunState::Released } => Some(run_id.as_str()),
                    _ => None,
                })
                .collect();
            for ev in &out.events {
                match ev {
                    Event::TokenTaken { owner, operation, harness, .. } => {
                        let k = (owner.clone(), operation.clone());
                        let had = held.insert(k, harness.clone());
                        prop_assert!(had.is_none() || had.as_deref() == Some(harness.as_str()));
                    }
                    Event::TokenFreed { owner, operation, .. } => {
                        // B3: never a tick (an expiry); only a request, or the owner's
                        // release of its run.
                        let owners_release = released.contains(&owner.as_str());
                        prop_assert!(
                            !is_tick && (by_request || owners_release),
                            "freed by {ev} outside a release"
                        );
                        let k = (owner.clone(), operation.clone());
                        prop_assert!(held.remove(&k).is_some(), "freed a token never taken: {ev}");
                    }
                    _ => {}
                }
            }
            e.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert_eq!(&tokens(&e), &held, "tokens moved without their events");
            if let Some(s) = e.scopes().get("x") {
                for (h, limit) in policy() {
                    prop_assert!(s.holders(&h) <= limit as usize, "{h} over its limit");
                }
            }
        }
    }
}

/// Regression: a turn's reservation under a waiting run's own key (its id, `run`) with
/// another harness was accepted, and the run's grant then found its key taken and
/// brought the engine (and the daemon) down. The turn is refused, and the run is
/// granted with its own token once one is free.
#[test]
fn regression_a_turn_under_a_waiting_runs_key_is_refused_and_the_grant_stands() {
    let mut cfg = Config::for_host(8, 16 * GIB, 0);
    cfg.memory_reserve = 0;
    cfg.disk_reserve = 0;
    cfg.default_request = Resources {
        slots: 1,
        ..Resources::default()
    };
    let mut e = Engine::new(cfg, 0).unwrap();
    let a = e.apply(0, Command::Acquire(request(0, 0, 30)));
    let fence = a.result.unwrap().unwrap().fence.unwrap();
    let b = e.apply(0, Command::Acquire(request(1, 0, 30)));
    assert_eq!(b.result.unwrap().unwrap().state, RunState::Queued);
    let turn = Command::Reserve {
        scope: "x".into(),
        owner: "r1".into(),
        operation_id: "run".into(),
        harness: "codex".into(),
    };
    let refused = e.apply(1, turn).result.unwrap_err();
    assert_eq!(refused.code(), "token_in_use", "{refused}");
    e.apply(
        2,
        Command::Release {
            run_id: "r0".into(),
            fence,
        },
    );
    let done = e.apply(
        3,
        Command::StopDone {
            run_id: "r0".into(),
            ok: true,
        },
    );
    assert!(done
        .events
        .iter()
        .any(|ev| matches!(ev, Event::Granted { run_id, .. } if run_id == "r1")));
    assert_eq!(
        e.scopes()
            .token("x", "r1", "run")
            .map(|t| t.harness.as_str()),
        Some("claude")
    );
    e.check_invariants().unwrap();
}
