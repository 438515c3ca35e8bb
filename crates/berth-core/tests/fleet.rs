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
