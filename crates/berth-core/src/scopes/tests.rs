use super::*;
use proptest::prelude::*;

fn policy(pairs: &[(&str, u32)]) -> Policy {
    pairs.iter().map(|(h, n)| (h.to_string(), *n)).collect()
}

fn scopes() -> Scopes {
    let mut s = Scopes::default();
    s.freeze(
        "exp",
        Some(&policy(&[("claude", 2), ("codex", 1)])),
        None,
        None,
        0,
    )
    .unwrap();
    s
}

/// B1: the first use freezes the policy; another policy is a conflict naming both; a
/// later use may leave it out; names and limits are checked.
#[test]
fn the_first_policy_is_frozen() {
    let mut s = scopes();
    assert_eq!(s.freeze("exp", None, None, None, 0), Ok(false));
    assert_eq!(
        s.freeze(
            "exp",
            Some(&policy(&[("claude", 2), ("codex", 1)])),
            None,
            None,
            0
        ),
        Ok(false)
    );
    match s.freeze("exp", Some(&policy(&[("claude", 3)])), None, None, 0) {
        Err(ScopeError::PolicyConflict { frozen, given, .. }) => {
            assert_eq!(frozen, policy(&[("claude", 2), ("codex", 1)]));
            assert_eq!(given, policy(&[("claude", 3)]));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        s.freeze("new", None, None, None, 0),
        Err(ScopeError::Invalid { .. })
    ));
    for bad in [
        policy(&[]),
        policy(&[("Claude", 1)]),
        policy(&[("claude", 0)]),
        policy(&[("claude", 1025)]),
        policy(&[("1x", 1)]),
    ] {
        assert!(
            matches!(
                s.freeze("new", Some(&bad), None, None, 0),
                Err(ScopeError::Invalid {
                    field: "per_harness",
                    ..
                })
            ),
            "{bad:?}"
        );
    }
    assert!(s.get("new").is_none(), "a refusal changes nothing");
}

/// B1: a manifest attached at first use is frozen with the policy; a later request with
/// another manifest (or one where none was frozen) is refused; leaving it out is fine.
#[test]
fn a_frozen_manifest_cannot_change() {
    let m = |sha: char| Manifest {
        path: "exp/manifest.json".into(),
        sha256: sha.to_string().repeat(64),
        execution_ids: vec!["e1".into(), "e2".into()],
    };
    let p = policy(&[("claude", 1)]);
    let mut s = Scopes::default();
    assert_eq!(s.freeze("m", Some(&p), Some(&m('a')), None, 0), Ok(true));
    assert_eq!(s.freeze("m", Some(&p), Some(&m('a')), None, 0), Ok(false));
    assert_eq!(s.freeze("m", None, None, None, 0), Ok(false));
    match s.freeze("m", None, Some(&m('b')), None, 0) {
        Err(e @ ScopeError::ManifestChanged { .. }) => {
            assert_eq!(e.code(), "scope_manifest_changed");
            assert!(e.to_string().contains(&"a".repeat(64)), "{e}");
        }
        other => panic!("{other:?}"),
    }
    s.freeze("plain", Some(&p), None, None, 0).unwrap();
    assert!(matches!(
        s.freeze("plain", None, Some(&m('a')), None, 0),
        Err(ScopeError::ManifestChanged { frozen: None, .. })
    ));
    let mut bad = m('a');
    bad.sha256 = "A".repeat(64);
    assert!(matches!(
        s.freeze("n", Some(&p), Some(&bad), None, 0),
        Err(ScopeError::Invalid {
            field: "manifest.sha256",
            ..
        })
    ));
    assert!(s.get("n").is_none());
}

/// B4: the control state machine, as a table: each row is a request and what it must
/// give (the scope's state and generation after it, or the refusal's code).
#[test]
fn the_control_state_machine() {
    use Mode::*;
    type Want = Result<(Control, u64), &'static str>;
    let rows: &[(&str, Mode, Want)] = &[
        ("a", Pause, Ok((Control::Paused, 1))),
        ("b", Resume, Ok((Control::Open, 2))),
        ("a", Pause, Ok((Control::Paused, 1))), // the same id again: the same receipt
        ("a", Stop, Err("control_conflict")),   // the same id, another mode
        ("c", Pause, Ok((Control::Paused, 3))),
        ("d", Stop, Ok((Control::Stopped, 4))), // pause -> stop
        ("e", Pause, Err("scope_stopped")),     // pause cannot weaken stop
        ("f", Resume, Err("scope_stopped")),    // resume never clears a stop
        ("d", Stop, Ok((Control::Stopped, 4))),
        ("g", Stop, Ok((Control::Stopped, 5))), // stop again is accepted, still terminal
    ];
    let mut s = scopes();
    for (i, (rid, mode, want)) in rows.iter().enumerate() {
        let got = s
            .control(i as u64, "exp", rid, *mode)
            .map(|r| (r.control, r.generation))
            .map_err(|e| e.code());
        assert_eq!(got, *want, "row {i}: {rid} {mode:?}");
        s.check_invariants().unwrap();
    }
    assert!(matches!(
        s.can_take("exp", "claude"),
        Err(ScopeError::Stopped { .. })
    ));
    assert!(matches!(
        s.control(0, "exp", "", Pause),
        Err(ScopeError::Invalid { .. })
    ));
}

/// B2/B3/B5: a retry reuses its token; another harness under the same key is refused;
/// the limit holds; a lapsed owner keeps its token until it is released or reconciled;
/// a pause stops new tokens but not held ones.
#[test]
fn reservations_are_idempotent_and_expiry_never_frees() {
    let mut s = scopes();
    assert_eq!(
        s.reserve(0, "exp", "w1", "op1", "claude", Some("r1")),
        Ok(Reserved::New)
    );
    assert_eq!(
        s.reserve(1, "exp", "w1", "op1", "claude", Some("r1")),
        Ok(Reserved::Existing)
    );
    assert!(matches!(
        s.reserve(1, "exp", "w1", "op1", "codex", None),
        Err(ScopeError::ReservationConflict { .. })
    ));
    assert_eq!(s.get("exp").unwrap().holders("claude"), 1);
    assert_eq!(
        s.reserve(2, "exp", "w2", "op1", "claude", None),
        Ok(Reserved::New)
    );
    match s.reserve(3, "exp", "w3", "op1", "claude", None) {
        Err(ScopeError::Full {
            limit: 2,
            holders: 2,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        s.reserve(3, "exp", "w3", "op1", "gemini", None),
        Err(ScopeError::UnknownHarness { .. })
    ));
    assert_eq!(s.lapse_owner("exp", "w1"), vec!["op1".to_string()]);
    let t = &s.get("exp").unwrap().tokens[&("w1".to_string(), "op1".to_string())];
    assert!(t.owner_lapsed, "marked, not freed");
    assert_eq!(s.get("exp").unwrap().holders("claude"), 2);
    s.control(4, "exp", "p", Mode::Pause).unwrap();
    assert!(matches!(
        s.reserve(5, "exp", "w4", "op", "codex", None),
        Err(ScopeError::Paused { .. })
    ));
    assert_eq!(
        s.reserve(5, "exp", "w2", "op1", "claude", None),
        Ok(Reserved::Existing),
        "held ones stay"
    );
    assert_eq!(s.reconcile("exp", "w1").unwrap().len(), 1);
    assert!(s.release("exp", "w1", "op1").is_err(), "already reconciled");
    assert!(s.release("exp", "w2", "op1").is_ok());
    assert_eq!(s.get("exp").unwrap().holders("claude"), 0);
}

#[derive(Clone, Debug)]
enum Op {
    Reserve { owner: u8, op: u8, harness: u8 },
    Release { owner: u8, op: u8 },
    Lapse { owner: u8 },
    Reconcile { owner: u8 },
    Control { rid: u8, mode: u8 },
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..6, 0u8..3, 0u8..3).prop_map(|(owner, op, harness)| Op::Reserve { owner, op, harness }),
        2 => (0u8..6, 0u8..3).prop_map(|(owner, op)| Op::Release { owner, op }),
        1 => (0u8..6).prop_map(|owner| Op::Lapse { owner }),
        1 => (0u8..6).prop_map(|owner| Op::Reconcile { owner }),
        1 => (0u8..6, 0u8..3).prop_map(|(rid, mode)| Op::Control { rid, mode }),
        1 => Just(Op::Restart),
    ]
}

proptest! {
    /// Random reservations, releases, lapses, reconciliations, controls and restarts
    /// never put a harness over its limit, never free a token by a lapse, and move the
    /// generation by exactly one per accepted new request.
    #[test]
    fn limits_hold_and_lapses_never_free(ops in proptest::collection::vec(op(), 1..120)) {
        let harnesses = ["claude", "codex", "gemini"];
        let mut s = Scopes::default();
        s.freeze("x", Some(&policy(&[("claude", 2), ("codex", 1), ("gemini", 3)])), None, None, 0).unwrap();
        let mut now = 0;
        for o in ops {
            now += 1;
            let before = s.get("x").unwrap().clone();
            match o {
                Op::Reserve { owner, op, harness } => {
                    let (w, p) = (format!("w{owner}"), format!("op{op}"));
                    let _ = s.reserve(now, "x", &w, &p, harnesses[harness as usize], Some(&format!("r{owner}")));
                }
                Op::Release { owner, op } => {
                    let _ = s.release("x", &format!("w{owner}"), &format!("op{op}"));
                }
                Op::Lapse { owner } => {
                    s.lapse_owner("x", &format!("w{owner}"));
                    let after = s.get("x").unwrap();
                    prop_assert_eq!(after.tokens.len(), before.tokens.len(), "a lapse freed a token");
                }
                Op::Reconcile { owner } => {
                    let _ = s.reconcile("x", &format!("w{owner}"));
                }
                Op::Control { rid, mode } => {
                    let mode = [Mode::Pause, Mode::Stop, Mode::Resume][mode as usize];
                    let fresh = !before.receipts.iter().any(|r| r.request_id == format!("q{rid}"));
                    let got = s.control(now, "x", &format!("q{rid}"), mode);
                    let after = s.get("x").unwrap();
                    let bumped = after.generation - before.generation;
                    prop_assert_eq!(bumped, u64::from(fresh && got.is_ok()));
                    if before.control == Control::Stopped {
                        prop_assert_eq!(after.control, Control::Stopped, "stop is terminal");
                    }
                }
                Op::Restart => {
                    let all: Vec<Scope> = s.iter().cloned().collect();
                    s = Scopes::default();
                    all.into_iter().for_each(|x| s.restore(x));
                }
            }
            s.check_invariants().map_err(TestCaseError::fail)?;
        }
    }
}

/// A hostile operator cannot make the scopes hold without bound: past
/// `TOKENS_HOST_MAX` tokens across all scopes a turn is refused (`budget_tokens_full`)
/// and a run waits (`HostFull`), until one comes back; past `SCOPES_MAX` no new scope
/// freezes.
#[test]
fn tokens_and_scopes_are_bounded_host_wide() {
    let wide: Policy = (0..HARNESSES_MAX)
        .map(|i| (format!("h{i}"), HARNESS_LIMIT_MAX))
        .collect();
    let mut s = Scopes::default();
    let per_scope = HARNESSES_MAX * HARNESS_LIMIT_MAX as usize;
    let scopes = TOKENS_HOST_MAX.div_ceil(per_scope) + 1;
    for i in 0..scopes {
        s.freeze(&format!("s{i}"), Some(&wide), None, None, 0)
            .unwrap();
    }
    let mut n = 0;
    'fill: for i in 0..scopes {
        for k in 0..per_scope {
            if n == TOKENS_HOST_MAX {
                break 'fill;
            }
            let h = format!("h{}", k % HARNESSES_MAX);
            s.reserve(0, &format!("s{i}"), &format!("o{k}"), "t", &h, None)
                .unwrap();
            n += 1;
        }
    }
    let last = format!("s{}", scopes - 1);
    assert_eq!(
        s.reserve(1, &last, "late", "t", "h0", None)
            .map_err(|e| e.code()),
        Err("budget_tokens_full")
    );
    assert_eq!(s.blocked(&last, "h0", "late", "t"), Some(Block::HostFull));
    s.release("s0", "o0", "t").unwrap();
    assert_eq!(s.blocked(&last, "h0", "late", "t"), None);
    assert!(s.reserve(2, &last, "late", "t", "h0", None).is_ok());
    s.check_invariants().unwrap();
    let mut few = Scopes::default();
    let p = policy(&[("claude", 1)]);
    for i in 0..SCOPES_MAX {
        few.freeze(&format!("x{i}"), Some(&p), None, None, 0)
            .unwrap();
    }
    assert_eq!(
        few.freeze("one-more", Some(&p), None, None, 0)
            .map_err(|e| e.code()),
        Err("scopes_full")
    );
}

/// A key that holds a token of another harness blocks a run under that key
/// (`Conflict`) rather than letting its grant find the key taken.
#[test]
fn a_key_holding_another_harness_blocks() {
    let mut s = scopes();
    s.reserve(0, "exp", "r1", "run", "codex", None).unwrap();
    assert_eq!(
        s.blocked("exp", "claude", "r1", "run"),
        Some(Block::Conflict)
    );
    assert_eq!(
        s.blocked("exp", "codex", "r1", "run"),
        None,
        "its own harness: reused"
    );
    assert_eq!(s.blocked("exp", "claude", "r2", "run"), None);
}

/// Issue 32 finding 6: 1,024 acquire+release cycles from one uid-bound token filled
/// `SCOPES_MAX` for good. Now one uid makes at most `SCOPES_PER_UID_MAX`, an idle scope
/// is forgotten after its window (freeing its owner's quota), and an operator may
/// delete one that nothing holds, never one that something does.
#[test]
fn finding_6_scopes_are_bounded_per_uid_and_idle_ones_are_forgotten() {
    let mut s = Scopes::default();
    let p = policy(&[("claude", 1)]);
    for i in 0..SCOPES_PER_UID_MAX {
        s.freeze(&format!("u{i}"), Some(&p), None, Some(1000), 10)
            .unwrap();
    }
    assert_eq!(
        s.freeze("u-more", Some(&p), None, Some(1000), 10)
            .map_err(|e| e.code()),
        Err("scopes_quota")
    );
    // Another user (and an unbound token) is not held back by uid 1000's scopes.
    assert_eq!(s.freeze("v0", Some(&p), None, Some(1001), 10), Ok(true));
    assert_eq!(s.freeze("w0", Some(&p), None, None, 10), Ok(true));
    s.check_invariants().unwrap();

    // Busy scopes are neither deleted nor forgotten: a run, a token, a control state.
    s.count_user("u0", true, 20);
    s.reserve(20, "u1", "o", "t", "claude", None).unwrap();
    s.control(20, "u2", "r1", Mode::Pause).unwrap();
    s.control(21, "u2", "r2", Mode::Resume).unwrap();
    for id in ["u0", "u1", "u2"] {
        assert_eq!(
            s.delete(id).map_err(|e| e.code()),
            Err("scope_in_use"),
            "{id}"
        );
    }
    assert_eq!(s.delete("nope").map_err(|e| e.code()), Err("not_found"));
    // Not yet past the window: nothing goes.
    assert!(s.prune_idle(1_009, 1_000).is_empty());
    let gone = s.prune_idle(1_010, 1_000);
    assert_eq!(gone.len(), SCOPES_PER_UID_MAX - 3 + 2, "{gone:?}");
    assert!(gone
        .iter()
        .all(|g| !["u0", "u1", "u2"].contains(&g.as_str())));
    s.check_invariants().unwrap();
    // uid 1000's quota has room again.
    assert_eq!(
        s.freeze("u-more", Some(&p), None, Some(1000), 2_000),
        Ok(true)
    );
    // The run ends and the token comes back: idle from then on, deletable now.
    s.count_user("u0", false, 2_000);
    s.release("u1", "o", "t").unwrap();
    assert_eq!(s.delete("u0"), Ok(()));
    assert_eq!(s.delete("u1"), Ok(()));
    assert!(s.get("u0").is_none() && s.get("u2").is_some());
    s.check_invariants().unwrap();
}

/// B4 fleet-wide (issue 38 Build 3): a control the fleet decided is taken only when it
/// is newer than the scope's generation (a read older than one already taken changes
/// nothing); one for a scope not used here waits until the scope is; the invariants
/// hold with generations decided elsewhere.
#[test]
fn a_fleet_control_is_taken_only_when_newer() {
    let mut s = scopes();
    let receipt = |id: &str, mode, generation, control| Receipt {
        request_id: id.into(),
        mode,
        generation,
        control,
        at_ms: 7,
    };
    assert!(s.mirror("exp", receipt("q3", Mode::Pause, 3, Control::Paused)));
    let e = s.get("exp").unwrap();
    assert_eq!(
        (e.control, e.generation, e.receipts.len()),
        (Control::Paused, 3, 1)
    );
    assert_eq!(
        s.can_take("exp", "claude").map_err(|e| e.code()),
        Err("scope_paused")
    );
    assert!(!s.mirror("exp", receipt("q2", Mode::Resume, 2, Control::Open)));
    assert!(!s.mirror("exp", receipt("q3", Mode::Pause, 3, Control::Paused)));
    assert_eq!(s.get("exp").unwrap().control, Control::Paused);
    s.check_invariants().unwrap();
    assert!(!s.mirror("later", receipt("q9", Mode::Stop, 9, Control::Stopped)));
    assert!(!s.mirror("later", receipt("q8", Mode::Pause, 8, Control::Paused)));
    assert!(s.get("later").is_none());
    let held = s
        .take_pending("later")
        .expect("held until the scope is used");
    assert_eq!((held.generation, held.control), (9, Control::Stopped));
    assert_eq!(s.take_pending("later"), None);
}
