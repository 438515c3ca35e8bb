//! P5 (engine part): an engine rebuilt from its own records answers exactly like the
//! original: same states, fences, positions, reasons and snapshot, and it goes on
//! issuing fences above every fence it issued before.

use berth_core::*;

fn req(id: &str, project: &str, mem_gib: u64, prio: Priority) -> Request {
    Request {
        run_id: id.into(),
        project: project.into(),
        class: Class::Managed,
        priority: prio,
        resources: Resources {
            slots: 1,
            memory: mem_gib * GIB,
            ..Resources::default()
        },
        singletons: vec![],
        contract: None,
        ttl_ms: 60_000,
        wait_ms: 600_000,
        budget: None,
    }
}

#[test]
fn restored_engine_matches_the_original() {
    let mut cfg = Config::for_host(8, 16 * GIB, 0);
    cfg.slots_max = 3;
    cfg.memory_reserve = 0;
    cfg.disk_reserve = 0;
    cfg.default_request.disk = 0;
    let mut e = Engine::new(cfg.clone(), 10).unwrap();
    let mut order = Vec::new();
    let mut now = 0;
    for (i, (p, m, prio)) in [
        ("a", 4, Priority::Foreground),
        ("a", 2, Priority::Foreground),
        ("b", 8, Priority::Foreground),
        ("c", 1, Priority::Background),
        ("d", 6, Priority::Foreground),
        ("e", 1, Priority::Foreground),
        ("f", 1, Priority::Background),
    ]
    .into_iter()
    .enumerate()
    {
        now += 100;
        let id = format!("r{i}");
        e.apply(now, Command::Acquire(req(&id, p, m, prio)));
        order.push(id);
    }
    let f = e.view_of("r0").unwrap().fence.unwrap();
    e.apply(
        now,
        Command::Release {
            run_id: "r0".into(),
            fence: f,
        },
    );
    e.apply(
        now,
        Command::StopDone {
            run_id: "r0".into(),
            ok: true,
        },
    );
    let f = e.view_of("r2").unwrap().fence.unwrap();
    e.apply(
        now,
        Command::Release {
            run_id: "r2".into(),
            fence: f,
        },
    );
    e.apply(
        now,
        Command::StopDone {
            run_id: "r2".into(),
            ok: false,
        },
    );
    e.check_invariants().unwrap();

    let records: Vec<RestoredRun> = order.iter().filter_map(|id| e.record(id)).collect();
    let mut r = Engine::restore(cfg, e.last_fence(), now, records).unwrap();
    for id in &order {
        assert_eq!(r.view_of(id), e.view_of(id), "run {id}");
    }
    assert_eq!(r.snapshot(), e.snapshot());
    let before = e.last_fence();
    // Both go on identically: release a holder, the same waiter gets the same new fence.
    let holder = order
        .iter()
        .find(|id| e.view_of(id).unwrap().state == RunState::Granted)
        .unwrap()
        .clone();
    let fence = e.view_of(&holder).unwrap().fence.unwrap();
    for eng in [&mut e, &mut r] {
        eng.apply(
            now + 1,
            Command::Release {
                run_id: holder.clone(),
                fence,
            },
        );
        let out = eng.apply(
            now + 1,
            Command::StopDone {
                run_id: holder.clone(),
                ok: true,
            },
        );
        assert!(out
            .events
            .iter()
            .any(|ev| matches!(ev, Event::Granted { fence, .. } if *fence > before)));
    }
    for id in &order {
        assert_eq!(r.view_of(id), e.view_of(id), "run {id} after continuing");
    }
}

#[test]
fn restore_refuses_contradictory_records() {
    let cfg = Config::for_host(8, 16 * GIB, 100 * GIB);
    let mut e = Engine::new(cfg.clone(), 0).unwrap();
    e.apply(0, Command::Acquire(req("x", "p", 1, Priority::Foreground)));
    let mut rec = e.record("x").unwrap();
    assert_eq!(rec.state, RunState::Granted);
    // Two exclusive holders of one runtime key cannot both be true.
    let mut twin = rec.clone();
    twin.request.run_id = "y".into();
    twin.fence = Some(1);
    assert!(Engine::restore(cfg.clone(), 1, 0, vec![rec.clone(), twin]).is_err());
    // A fence above the counter means the ledger is damaged.
    rec.fence = Some(9);
    assert!(Engine::restore(cfg, 1, 0, vec![rec]).is_err());
}
