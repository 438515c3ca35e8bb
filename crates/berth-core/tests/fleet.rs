//! F1 at the engine level: on a fleet host a run is granted only with a permit (its
//! fleet-wide claim), the grant carries the permit's fence, the engine asks once per
//! run and only when everything local fits, and a `wait_s = 0` run arrives with its
//! permit. Invariants are checked after every step.

use berth_core::*;

fn cfg(fleet: bool) -> Config {
    let mut c = Config::for_host(8, 64 * GIB, 1000 * GIB);
    c.slots_max = 2;
    c.fleet = fleet;
    c
}

fn req(id: &str, wait_ms: u64, singletons: &[&str]) -> Request {
    Request {
        run_id: id.into(),
        project: format!("p-{id}"),
        class: Class::Managed,
        priority: Priority::Foreground,
        resources: Resources {
            slots: 1,
            ..Resources::default()
        },
        singletons: singletons.iter().map(|s| s.to_string()).collect(),
        contract: None,
        ttl_ms: 60_000,
        wait_ms,
        budget: None,
    }
}

fn apply(e: &mut Engine, now: u64, cmd: Command) -> Output {
    let out = e.apply(now, cmd);
    e.check_invariants().unwrap();
    out
}

fn wanted(out: &Output) -> Vec<String> {
    out.events
        .iter()
        .filter_map(|ev| match ev {
            Event::PermitWanted { run_id } => Some(run_id.clone()),
            _ => None,
        })
        .collect()
}

fn granted(out: &Output) -> Vec<(String, u64)> {
    out.events
        .iter()
        .filter_map(|ev| match ev {
            Event::Granted { run_id, fence, .. } => Some((run_id.clone(), *fence)),
            _ => None,
        })
        .collect()
}

fn permit(id: &str, fence: u64) -> Command {
    Command::Permit {
        run_id: id.into(),
        fence,
    }
}

#[test]
fn a_fleet_run_is_granted_only_with_its_permit_and_carries_its_fence() {
    let mut e = Engine::new(cfg(true), 0).unwrap();
    let out = apply(&mut e, 0, Command::Acquire(req("a", 60_000, &[])));
    assert_eq!(wanted(&out), ["a"]);
    assert!(granted(&out).is_empty());
    assert_eq!(e.reason_of("a").unwrap().code, "fleet.claim");
    // Asked once: later passes do not ask again.
    let out = apply(&mut e, 10, Command::Tick);
    assert!(wanted(&out).is_empty());
    // The permit's fence is the grant's, whatever the host's own counter says.
    let out = apply(&mut e, 20, permit("a", 1_000));
    assert_eq!(granted(&out), [("a".to_string(), 1_000)]);
    assert_eq!(e.last_fence(), 1_000);
    // A permit whose fence is not above the host's last (another run's later permit
    // was granted first) is stale: the engine asks for a new fence (L1's order).
    apply(&mut e, 30, Command::Acquire(req("b", 60_000, &[])));
    let out = apply(&mut e, 40, permit("b", 900));
    assert!(granted(&out).is_empty());
    assert_eq!(wanted(&out), ["b"], "asked again for a fence above 1,000");
    let out = apply(&mut e, 50, permit("b", 1_001));
    assert_eq!(granted(&out), [("b".to_string(), 1_001)]);
    assert_eq!(e.last_fence(), 1_001);
}

#[test]
fn the_fleet_is_asked_only_for_a_run_that_fits_here() {
    let mut e = Engine::new(cfg(true), 0).unwrap();
    apply(&mut e, 0, Command::Acquire(req("a", 60_000, &[])));
    apply(&mut e, 1, permit("a", 5));
    apply(&mut e, 2, Command::Acquire(req("b", 60_000, &[])));
    apply(&mut e, 3, permit("b", 6));
    // Both slots are taken: c waits for capacity, not for the fleet.
    let out = apply(&mut e, 4, Command::Acquire(req("c", 60_000, &[])));
    assert!(wanted(&out).is_empty());
    assert_eq!(e.reason_of("c").unwrap().code, "capacity.slots");
    let out = apply(
        &mut e,
        5,
        Command::Release {
            run_id: "a".into(),
            fence: 5,
        },
    );
    let out2 = apply(
        &mut e,
        6,
        Command::StopDone {
            run_id: "a".into(),
            ok: true,
        },
    );
    let asked: Vec<String> = wanted(&out).into_iter().chain(wanted(&out2)).collect();
    assert_eq!(asked, ["c"], "asked once a slot came free");
}

#[test]
fn a_permit_is_refused_for_a_run_that_is_not_waiting() {
    let mut e = Engine::new(cfg(true), 0).unwrap();
    assert!(matches!(
        apply(&mut e, 0, permit("ghost", 3)).result,
        Err(Error::NotFound { .. })
    ));
    apply(&mut e, 1, Command::Acquire(req("a", 60_000, &[])));
    apply(&mut e, 2, permit("a", 3));
    assert!(matches!(
        apply(&mut e, 3, permit("a", 4)).result,
        Err(Error::Invalid {
            field: "permit",
            ..
        })
    ));
    assert_eq!(e.fence_of("a"), Some(3), "a second permit changes nothing");
    // A host that is not in a fleet takes no permits and grants as before.
    let mut solo = Engine::new(cfg(false), 0).unwrap();
    let out = apply(&mut solo, 0, Command::Acquire(req("a", 60_000, &[])));
    assert_eq!(granted(&out), [("a".to_string(), 1)]);
    assert!(apply(&mut solo, 1, permit("a", 9)).result.is_err());
}

#[test]
fn a_wait_0_run_arrives_with_its_permit_and_without_one_expires() {
    let mut e = Engine::new(cfg(true), 0).unwrap();
    let cmd = Command::AcquirePermitted {
        req: req("now", 0, &[]),
        fence: 77,
    };
    let out = apply(&mut e, 0, cmd);
    assert_eq!(granted(&out), [("now".to_string(), 77)]);
    let out = apply(&mut e, 1, Command::Acquire(req("late", 0, &[])));
    assert!(granted(&out).is_empty());
    assert_eq!(e.view_of("late").unwrap().state, RunState::Expired);
}

#[test]
fn fleet_singletons_are_named_and_bounded() {
    let mut e = Engine::new(cfg(true), 0).unwrap();
    let r = apply(&mut e, 0, Command::Acquire(req("a", 1_000, &["fleet:"]))).result;
    assert!(
        matches!(
            r,
            Err(Error::Invalid {
                field: "singletons",
                ..
            })
        ),
        "{r:?}"
    );
    let many: Vec<String> = (0..=FLEET_KEYS_MAX)
        .map(|i| format!("fleet:k{i}"))
        .collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    let r = apply(&mut e, 1, Command::Acquire(req("b", 1_000, &many))).result;
    assert!(
        matches!(
            r,
            Err(Error::Invalid {
                field: "singletons",
                ..
            })
        ),
        "{r:?}"
    );
    apply(
        &mut e,
        2,
        Command::Acquire(req("c", 1_000, &["fleet:db", "local"])),
    );
    let needs = e.fleet_needs("c").unwrap();
    assert_eq!(needs.keys, ["db"]);
    assert_eq!(needs.token, None);
}

fn returned(out: &Output) -> Vec<String> {
    out.events
        .iter()
        .filter_map(|ev| match ev {
            Event::PermitReturned { run_id } => Some(run_id.clone()),
            _ => None,
        })
        .collect()
}

/// Issue 38 item 6 (A1): a waiter that got its permit (its fleet-wide claim, a fleet
/// key among it) while the starvation guard held it back for the head kept the claim.
/// The head needs the same key: its claim was refused for as long as the waiter held
/// it, and the waiter was never granted before the head: both waited until the head's
/// wait ran out. The held-back waiter gives its permit back, and is asked again once
/// it may be granted.
#[test]
fn regression_a_waiter_held_back_for_the_head_gives_its_permit_back() {
    let mut e = Engine::new(cfg(true), 0).unwrap();
    apply(&mut e, 0, Command::Acquire(req("x", 600_000, &[])));
    apply(&mut e, 1, permit("x", 1));
    let mut head = req("h", 600_000, &["fleet:k"]);
    head.resources.slots = 2;
    let out = apply(&mut e, 2, Command::Acquire(head));
    assert!(wanted(&out).is_empty(), "the head waits for a slot first");
    let out = apply(&mut e, 3, Command::Acquire(req("s", 600_000, &["fleet:k"])));
    assert_eq!(wanted(&out), ["s"], "no guard yet: s fits beside the head");
    let guard_ms = e.config().starvation_guard_ms;
    apply(&mut e, 4 + guard_ms, Command::Tick);
    // Its claim arrives after the guard took hold: s is held back, its permit goes back.
    let out = apply(&mut e, 5 + guard_ms, permit("s", 2));
    assert!(granted(&out).is_empty());
    assert_eq!(returned(&out), ["s"], "s keeps the key the head needs");
    // x ends: the head asks for its claim (the key is free fleet-wide) and is granted.
    let t = 6 + guard_ms;
    let release = Command::Release {
        run_id: "x".into(),
        fence: 1,
    };
    let mut out = apply(&mut e, t, release);
    let done = Command::StopDone {
        run_id: "x".into(),
        ok: true,
    };
    out.events.extend(apply(&mut e, t + 1, done).events);
    assert_eq!(wanted(&out), ["h"]);
    let out = apply(&mut e, t + 2, permit("h", 3));
    assert_eq!(granted(&out), [("h".to_string(), 3)]);
    // The head ends: s is asked for its claim again, and granted with it.
    let release = Command::Release {
        run_id: "h".into(),
        fence: 3,
    };
    let mut out = apply(&mut e, t + 3, release);
    let done = Command::StopDone {
        run_id: "h".into(),
        ok: true,
    };
    out.events.extend(apply(&mut e, t + 4, done).events);
    assert_eq!(wanted(&out), ["s"], "asked again once it may be granted");
    let out = apply(&mut e, t + 5, permit("s", 4));
    assert_eq!(granted(&out), [("s".to_string(), 4)]);
}
