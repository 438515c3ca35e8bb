use super::*;
use proptest::prelude::*;

fn owner(gen: &str, fence: u64, run: &str) -> Owner {
    Owner {
        gen: gen.into(),
        fence,
        run_id: run.into(),
    }
}

fn cfg() -> ThreadConfig {
    ThreadConfig {
        idle_after_ms: 1_000,
        ttl_ms: 10_000,
        grace_ms: 100,
        disk_free_min: 0,
    }
}

/// G2: a delayed claim from an older owner is refused and names the newer one, even
/// after the newer one detached; the same fence with another generation is refused.
#[test]
fn a_lower_or_rival_claim_never_reopens_a_thread() {
    let mut t = Threads::new(cfg());
    let new = owner("g2", 7, "r2");
    assert_eq!(
        t.attach(0, "k", owner("g1", 5, "r1"), 500, false),
        Ok(Attached::Registered)
    );
    assert_eq!(
        t.attach(10, "k", new.clone(), 500, false),
        Ok(Attached::Registered)
    );
    assert_eq!(t.detach(20, "k", &new, false), Ok(false));
    for late in [
        owner("g1", 5, "r1"),
        owner("g1", 6, "r9"),
        owner("gx", 7, "r2"),
        owner("g2", 7, "r3"),
    ] {
        match t.attach(30, "k", late.clone(), 500, false) {
            Err(ThreadError::Mismatch { current, .. }) => assert_eq!(current, new, "{late:?}"),
            other => panic!("{late:?}: {other:?}"),
        }
    }
    assert_eq!(
        t.attach(40, "k", new.clone(), 500, false),
        Ok(Attached::Registered)
    );
}

/// G3: only the owner tightens or detaches; a deadline never passes a day after the
/// attach; the owner check comes before the drain gate (409 before 503).
#[test]
fn only_the_owner_changes_a_registration_and_mismatch_comes_before_drain() {
    let mut t = Threads::new(cfg());
    let o = owner("g", 3, "r");
    t.attach(0, "k", o.clone(), 1_000, false).unwrap();
    let rival = owner("h", 9, "s");
    assert!(matches!(
        t.set_deadline(5, "k", &rival, 10),
        Err(ThreadError::Mismatch { .. })
    ));
    assert!(matches!(
        t.detach(5, "k", &rival, true),
        Err(ThreadError::Mismatch { .. })
    ));
    assert_eq!(t.set_deadline(5, "k", &o, 10), Ok(15));
    assert!(
        matches!(
            t.set_deadline(RUN_BUDGET_MS_MAX - 5, "k", &o, 10),
            Err(ThreadError::NotFound { .. })
        ),
        "lapsed by then"
    );
    assert!(matches!(
        t.attach(6, "k", owner("g", 2, "r"), 10, true),
        Err(ThreadError::Mismatch { .. })
    ));
    assert_eq!(
        t.attach(6, "k", o.clone(), 10, true),
        Ok(Attached::Unchanged)
    );
    assert_eq!(
        t.attach(6, "k", owner("g", 4, "r"), 10, true),
        Err(ThreadError::Draining)
    );
    assert_eq!(t.attach(6, "new", o, 10, true), Err(ThreadError::Draining));
    assert!(t.get("new").is_none(), "a refusal changes nothing");
}

/// G0/G1: a live registration protects from idle and ttl eviction; once it lapses
/// (deadline + grace) the sweep evicts with the right reason.
#[test]
fn the_sweep_spares_live_registrations_and_says_why_it_evicts() {
    let mut t = Threads::new(cfg());
    let o = owner("g", 1, "r");
    t.attach(0, "k", o.clone(), 5_000, false).unwrap();
    t.made_workspace(0, "k");
    assert!(
        t.due(4_000, |_| false).is_empty(),
        "idle long, but registered"
    );
    assert!(t.check_operator_evict(4_000, "k").is_err());
    assert!(t.due(5_099, |_| false).is_empty(), "within grace");
    assert_eq!(
        t.due(5_100, |_| false),
        vec![("k".to_string(), EvictReason::Idle)]
    );
    assert!(
        t.due(5_100, |k| k == "k").is_empty(),
        "a live run works in it"
    );
    assert_eq!(
        t.due(10_000, |_| false),
        vec![("k".to_string(), EvictReason::Ttl)]
    );
    t.evicted(10_000, "k", EvictReason::Ttl);
    assert!(t.due(20_000, |_| false).is_empty(), "nothing left to evict");
    assert_eq!(
        t.get("k").unwrap().owner.as_ref(),
        Some(&o),
        "the owner stays (G2)"
    );
}

/// Under disk pressure the least recently used unprotected thread is the one to go;
/// a registered one, or one a live run works in, is protected (and named).
#[test]
fn disk_pressure_takes_the_least_recently_used_unprotected_thread() {
    let mut t = Threads::new(cfg());
    for (i, k) in ["old", "new", "reg", "busy"].iter().enumerate() {
        t.ensure(i as u64 * 10, k).unwrap();
        t.made_workspace(i as u64 * 10, k);
    }
    t.attach(50, "reg", owner("g", 1, "r"), 1_000, false)
        .unwrap();
    t.touch(60, "old");
    let (victim, protected) = t.pressure(70, |k| k == "busy");
    assert_eq!(
        victim.as_deref(),
        Some("new"),
        "old was used at 60, new at 10"
    );
    assert_eq!(protected, vec!["reg".to_string()]);
    t.evicted(70, "new", EvictReason::DiskPressure);
    assert_eq!(t.pressure(70, |k| k == "busy").0.as_deref(), Some("old"));
    assert_eq!(
        EvictReason::parse("disk_pressure"),
        Some(EvictReason::DiskPressure)
    );
}

#[test]
fn claims_are_validated_before_anything_changes() {
    let mut t = Threads::new(cfg());
    let bad = [
        ("", owner("g", 1, "r"), 1, "key"),
        ("k", owner("", 1, "r"), 1, "owner_gen"),
        ("k", owner("g", 0, "r"), 1, "owner_fence"),
        ("k", owner("g", FENCE_SAFE_MAX + 1, "r"), 1, "owner_fence"),
        ("k", owner("g", 1, "r r"), 1, "run_id"),
        ("k", owner("g", 1, "r"), 0, "run_budget_ms"),
        (
            "k",
            owner("g", 1, "r"),
            RUN_BUDGET_MS_MAX + 1,
            "run_budget_ms",
        ),
    ];
    for (key, o, budget, field) in bad {
        match t.attach(0, key, o, budget, false) {
            Err(ThreadError::Invalid { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: {other:?}"),
        }
    }
    assert!(t.is_empty());
}

#[derive(Clone, Debug)]
enum Op {
    Attach {
        key: u8,
        gen: u8,
        fence: u64,
        run: u8,
        budget: u64,
    },
    Deadline {
        key: u8,
        gen: u8,
        fence: u64,
        run: u8,
        budget: u64,
    },
    Detach {
        key: u8,
        gen: u8,
        fence: u64,
        run: u8,
        evict: bool,
    },
    Drain(bool),
    Wait(u64),
    Sweep,
    /// The daemon restarts: the threads come back from their records.
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    let claim = || (0u8..3, 0u8..2, 1u64..6, 0u8..2);
    prop_oneof![
        (claim(), 1u64..3_000).prop_map(|((key, gen, fence, run), budget)| Op::Attach {
            key,
            gen,
            fence,
            run,
            budget
        }),
        (claim(), 1u64..3_000).prop_map(|((key, gen, fence, run), budget)| Op::Deadline {
            key,
            gen,
            fence,
            run,
            budget
        }),
        (claim(), any::<bool>()).prop_map(|((key, gen, fence, run), evict)| Op::Detach {
            key,
            gen,
            fence,
            run,
            evict
        }),
        any::<bool>().prop_map(Op::Drain),
        (1u64..2_000).prop_map(Op::Wait),
        Just(Op::Sweep),
        Just(Op::Restart),
    ]
}

proptest! {
    /// Under random attach, deadline, detach, drain, sweeps and restarts, against a
    /// reference model of the three rules: (a) no thread is ever reopened by
    /// a lower `(gen, fence)`, (b) no workspace is evicted while its registration is
    /// live, (c) a drain never admits a new owner. Invariants checked after each step.
    #[test]
    fn registrations_follow_the_rules(ops in proptest::collection::vec(op(), 1..80)) {
        let mut t = Threads::new(cfg());
        let mut now = 0u64;
        let mut draining = false;
        // The model: per key, the highest accepted owner; per key, live-until.
        let mut best: BTreeMap<String, Owner> = BTreeMap::new();
        let mut live_until: BTreeMap<String, u64> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Attach { key, gen, fence, run, budget } => {
                    let k = format!("k{key}");
                    let o = owner(&format!("g{gen}"), fence, &format!("r{run}"));
                    let before = t.get(&k).and_then(|x| x.owner.clone());
                    match t.attach(now, &k, o.clone(), budget, draining) {
                        Ok(a) => {
                            if let Some(b) = best.get(&k) {
                                prop_assert!(o.fence > b.fence || o == *b, "(a) {o:?} after {b:?}");
                            }
                            if draining {
                                prop_assert_eq!(a, Attached::Unchanged, "(c) drain admitted {:?}", o);
                                prop_assert_eq!(before.as_ref(), Some(&o));
                            }
                            if a == Attached::Registered {
                                live_until.insert(k.clone(), now + budget + cfg().grace_ms);
                                t.made_workspace(now, &k);
                            }
                            best.insert(k, o);
                        }
                        Err(ThreadError::Mismatch { current, .. }) => {
                            prop_assert_eq!(Some(&current), best.get(&k));
                        }
                        Err(ThreadError::Draining) => prop_assert!(draining),
                        Err(e) => prop_assert!(false, "{e:?}"),
                    }
                }
                Op::Deadline { key, gen, fence, run, budget } => {
                    let k = format!("k{key}");
                    let o = owner(&format!("g{gen}"), fence, &format!("r{run}"));
                    if let Ok(d) = t.set_deadline(now, &k, &o, budget) {
                        prop_assert_eq!(best.get(&k), Some(&o), "(G3) only the owner");
                        live_until.insert(k, d + cfg().grace_ms);
                    }
                }
                Op::Detach { key, gen, fence, run, evict } => {
                    let k = format!("k{key}");
                    let o = owner(&format!("g{gen}"), fence, &format!("r{run}"));
                    if let Ok(must) = t.detach(now, &k, &o, evict) {
                        prop_assert_eq!(best.get(&k), Some(&o), "(G3) only the owner");
                        live_until.remove(&k);
                        if must {
                            t.evicted(now, &k, EvictReason::Detach);
                        }
                    }
                }
                Op::Drain(on) => draining = on,
                Op::Restart => {
                    let records: Vec<Thread> = t.iter().cloned().collect();
                    t = Threads::new(cfg());
                    records.into_iter().for_each(|r| t.restore(r));
                }
                Op::Wait(ms) => now += ms,
                Op::Sweep => {
                    for (k, why) in t.due(now, |_| false) {
                        let until = live_until.get(&k).copied().unwrap_or(0);
                        prop_assert!(now >= until, "(b) {k} evicted ({why:?}) while live until {until}");
                        t.evicted(now, &k, why);
                    }
                }
            }
            t.check_invariants().map_err(TestCaseError::fail)?;
        }
    }
}
