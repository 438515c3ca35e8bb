//! Data-driven scenario tests: each `scenarios/*.txt` is a script of commands; the trace
//! of decisions it produces is compared with a checked-in insta snapshot. The invariant
//! checker runs after every step. Script syntax is documented in `scenarios/README.md`.

use std::collections::BTreeMap;
use std::fmt::Write;

use berth_core::validate::{parse_duration_ms, parse_size};
use berth_core::*;

fn parse_kv(words: &[&str]) -> (Vec<String>, BTreeMap<String, String>) {
    let mut pos = Vec::new();
    let mut kv = BTreeMap::new();
    for w in words {
        match w.split_once('=') {
            Some((k, v)) => {
                kv.insert(k.to_string(), v.to_string());
            }
            None => pos.push(w.to_string()),
        }
    }
    (pos, kv)
}

fn size(v: &str) -> u64 {
    parse_size(v).unwrap_or_else(|e| panic!("bad size {v}: {e}"))
}

fn dur(v: &str) -> u64 {
    parse_duration_ms(v).unwrap_or_else(|e| panic!("bad duration {v}: {e}"))
}

fn config(kv: &BTreeMap<String, String>) -> Config {
    let mut c = Config::for_host(8, 16 * GIB, 0);
    c.slots_max = 4;
    c.memory_reserve = 0;
    c.cpu_reserve_millis = 0;
    c.disk_reserve = 0;
    c.default_request.disk = 0;
    for (k, v) in kv {
        match k.as_str() {
            "slots" => c.slots_max = v.parse().unwrap(),
            "memory" => c.memory_total = size(v),
            "memory_reserve" => c.memory_reserve = size(v),
            "memory_reserve_idle" => c.memory_reserve_idle = Some(size(v)),
            "cpu_pressure_max" => c.pressure_cpu_max_bp = percent_bp(v),
            "io_pressure_max" => c.pressure_io_max_bp = percent_bp(v),
            "cpu" => c.cpu_total_millis = v.parse().unwrap(),
            "cpu_reserve" => c.cpu_reserve_millis = v.parse().unwrap(),
            "disk" => c.disk_total = size(v),
            "disk_reserve" => c.disk_reserve = size(v),
            "window" => c.window = v.parse().unwrap(),
            "guard" => c.starvation_guard_ms = dur(v),
            "stabilize" => c.stabilize_samples = v.parse().unwrap(),
            "settle" => c.pending_settle_ms = dur(v),
            "queue_max" => c.queue_len_max = v.parse().unwrap(),
            "ended_max" => c.ended_retained_max = v.parse().unwrap(),
            "default_mem" => c.default_request.memory = size(v),
            "default_cpu" => c.default_request.cpu_millis = v.parse().unwrap(),
            "default_disk" => c.default_request.disk = size(v),
            name => c.named.push((name.to_string(), v.parse().unwrap())),
        }
    }
    c
}

/// `fleet-evidence PROJECT ev=fp[:commit] valid=true|false`.
fn fleet_evidence(project: String, kv: &BTreeMap<String, String>) -> Command {
    let c = contract(&format!(
        "parallel:{}",
        kv.get("ev").expect("ev=fp[:commit]")
    ));
    Command::FleetEvidence {
        project,
        evidence: berth_core::Evidence {
            fingerprint: c.fingerprint,
            commit: c.commit,
            ports: vec!["web".into()],
            at_ms: 0,
            run_id: "elsewhere".into(),
        },
        valid: kv.get("valid").is_none_or(|v| v == "true"),
    }
}

fn contract(v: &str) -> ContractInfo {
    // concurrency:fingerprint[:commit]
    let mut parts = v.split(':');
    let concurrency = match parts.next().unwrap() {
        "serial" => Concurrency::Serial,
        "parallel" => Concurrency::Parallel,
        "disabled" => Concurrency::Disabled,
        other => panic!("bad concurrency {other}"),
    };
    ContractInfo {
        concurrency,
        fingerprint: parts.next().unwrap_or("fp").to_string(),
        commit: parts.next().map(str::to_string),
    }
}

fn request(id: &str, kv: &BTreeMap<String, String>, named: &[(String, u64)]) -> Request {
    let g = |k: &str| kv.get(k).map(String::as_str);
    let mut res = Resources {
        slots: g("slots").map_or(1, |v| v.parse().unwrap()),
        memory: g("mem").map_or(0, size),
        cpu_millis: g("cpu").map_or(0, |v| v.parse().unwrap()),
        disk: g("disk").map_or(0, size),
        named: BTreeMap::new(),
    };
    for (name, _) in named {
        if let Some(v) = g(name) {
            res.named.insert(name.clone(), v.parse().unwrap());
        }
    }
    if let Some(v) = g("res") {
        // res=name:count for undeclared names (to test refusal)
        let (n, c) = v.split_once(':').unwrap();
        res.named.insert(n.to_string(), c.parse().unwrap());
    }
    Request {
        run_id: id.to_string(),
        project: g("project").unwrap_or("p").to_string(),
        class: match g("class").unwrap_or("managed") {
            "managed" => Class::Managed,
            "analysis" => Class::Analysis,
            other => panic!("bad class {other}"),
        },
        priority: match g("prio").unwrap_or("fg") {
            "fg" => Priority::Foreground,
            "bg" => Priority::Background,
            other => panic!("bad prio {other}"),
        },
        resources: res,
        singletons: g("singleton")
            .map(|v| v.split(',').map(str::to_string).collect())
            .unwrap_or_default(),
        contract: g("contract").map(contract),
        ttl_ms: g("ttl").map_or(60_000, dur),
        wait_ms: g("wait").map_or(600_000, dur),
        budget: g("budget").map(|v| Box::new(budget(v, g("policy"), g("op")))),
    }
}

/// `budget=scope:harness`, with `policy=claude:2,codex:1` and `op=ID` (B1, B2).
fn budget(v: &str, policy: Option<&str>, op: Option<&str>) -> scopes::Budget {
    let (scope, harness) = v.split_once(':').expect("budget=scope:harness");
    scopes::Budget {
        scope: scope.to_string(),
        harness: harness.to_string(),
        operation_id: op.map(str::to_string),
        per_harness: policy.map(|p| {
            p.split(',')
                .map(|x| {
                    let (h, n) = x.split_once(':').expect("policy=harness:limit,...");
                    (h.to_string(), n.parse().unwrap())
                })
                .collect()
        }),
        manifest: None,
        tenant: None,
    }
}

/// `scope ID`: the scope's control, generation and tokens (B6).
fn show_scope(out: &mut String, e: &Engine, id: &str) {
    let Some(s) = e.scopes().get(id) else {
        writeln!(out, "  = no scope").unwrap();
        return;
    };
    writeln!(out, "  = scope {id} {:?} gen={}", s.control, s.generation).unwrap();
    for ((owner, op), t) in &s.tokens {
        write!(out, "  | {owner}/{op} {}", t.harness).unwrap();
        if t.owner_lapsed {
            write!(out, " owner_lapsed").unwrap();
        }
        out.push('\n');
    }
    for v in e.scope_waiters(id, 100).0 {
        show_view(out, &v);
    }
}

fn show_view(out: &mut String, v: &RunView) {
    write!(out, "  = {} {}", v.run_id, v.state.as_str()).unwrap();
    if let Some(f) = v.fence {
        write!(out, " fence={f}").unwrap();
    }
    if let Some(p) = v.position {
        write!(out, " pos={p}").unwrap();
    }
    if let Some(r) = &v.reason {
        write!(out, " reason={r}").unwrap();
    }
    out.push('\n');
}

fn show_snapshot(out: &mut String, s: &Snapshot) {
    for r in &s.resources {
        writeln!(
            out,
            "  | {} total={} reserve={} alloc={} committed={} available={}",
            r.name, r.total, r.reserve, r.allocatable, r.committed, r.available
        )
        .unwrap();
    }
    writeln!(
        out,
        "  | slots_max={} effective_max_now={} mem_available={:?} pending={} queued={}+{} granted={} releasing={} degraded={} last_fence={}",
        s.slots_max, s.effective_max_now, s.memory_available, s.memory_pending,
        s.queued_foreground, s.queued_background, s.granted, s.releasing, s.degraded, s.last_fence
    )
    .unwrap();
    if let Some(r) = &s.min_run_blocked {
        writeln!(out, "  | min_run_blocked={r}").unwrap();
    }
    for p in &s.projects {
        write!(
            out,
            "  | project {} active={} waiting={} degraded={} class={}",
            p.name,
            p.active,
            p.waiting,
            p.degraded,
            p.concurrency.as_str()
        )
        .unwrap();
        if let Some(e) = &p.evidence {
            write!(
                out,
                " evidence={}@{:?} by {} ports={}",
                e.fingerprint,
                e.commit,
                e.run_id,
                e.ports.join(",")
            )
            .unwrap();
        }
        out.push('\n');
    }
}

/// `sample 8GiB` (MemAvailable), `pressure 12.50%` (memory) or `pressure cpu 40.00%`,
/// `disk-free 40GiB`: one figure of a host sample (issue 36).
fn host_sample(verb: &str, pos: &[String]) -> Command {
    let kind = |k: &str| match k {
        "memory" => PressureKind::Memory,
        "cpu" => PressureKind::Cpu,
        "io" => PressureKind::Io,
        other => panic!("bad pressure kind {other}"),
    };
    Command::Sample(match (verb, pos) {
        ("sample", [m]) => HostSample::memory(size(m)),
        ("pressure", [k, figure]) => HostSample::pressure(kind(k), percent_bp(figure)),
        ("pressure", [figure]) => HostSample::pressure(PressureKind::Memory, percent_bp(figure)),
        ("disk-free", [d]) => HostSample::disk(size(d)),
        _ => panic!("bad {verb} {pos:?}"),
    })
}

pub fn run_script(script: &str) -> String {
    let mut out = String::new();
    let mut engine: Option<Engine> = None;
    for line in script.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        if words[0] == "config" {
            let (_, kv) = parse_kv(&words[1..]);
            let fence = kv.get("last_fence").map_or(0, |v| v.parse().unwrap());
            let mut kv = kv;
            kv.remove("last_fence");
            engine = Some(Engine::new(config(&kv), fence).expect("valid config"));
            writeln!(out, "{line}").unwrap();
            continue;
        }
        let e = engine.get_or_insert_with(|| Engine::new(config(&BTreeMap::new()), 0).unwrap());
        writeln!(out, "> {line}").unwrap();
        match words[0] {
            "show" => {
                match e.view_of(words[1]) {
                    Some(v) => show_view(&mut out, &v),
                    None => writeln!(out, "  = unknown").unwrap(),
                }
                continue;
            }
            "status" => {
                show_snapshot(&mut out, &e.snapshot());
                continue;
            }
            "scope" => {
                show_scope(&mut out, e, words[1]);
                continue;
            }
            "at" => {}
            other => panic!("unknown directive {other}"),
        }
        let now = dur(words[1]);
        let verb = words[2];
        let (pos, kv) = parse_kv(&words[3..]);
        let id = || pos.first().cloned().expect("run id");
        let fence = || kv.get("fence").map(|v| v.parse::<u64>().unwrap());
        let cmd = match verb {
            "acquire" => Command::Acquire(request(&id(), &kv, &e.config().named)),
            "cancel" => Command::Cancel { run_id: id() },
            "renew" => Command::Renew {
                run_id: id(),
                fence: fence(),
                ttl_ms: kv.get("ttl").map(|v| dur(v)),
            },
            "release" => Command::Release {
                run_id: id(),
                fence: fence().expect("fence"),
            },
            "stopped" => Command::StopDone {
                run_id: id(),
                ok: !pos.iter().any(|p| p == "fail"),
            },
            "tick" => Command::Tick,
            "drain" => Command::Drain {
                on: pos.first().is_some_and(|p| p == "on"),
            },
            "sample" | "pressure" | "disk-free" => host_sample(verb, &pos),
            // `settle a fence=1`: the run's tree started and was sampled (issue 36).
            "settle" => Command::Settle {
                run_id: id(),
                fence: fence().expect("fence"),
            },
            "promote" => Command::Promote {
                run_id: id(),
                fence: fence().expect("fence"),
                ports: kv
                    .get("ports")
                    .map(|v| v.split(',').map(str::to_string).collect())
                    .unwrap_or_default(),
            },
            // `fleet-evidence web ev=fpA:c1 valid=true|false`: evidence the fleet
            // holds (issue 38 Build 3), proven or found wrong on another host.
            "fleet-evidence" => fleet_evidence(id(), &kv),
            "runtime-failed" => Command::RuntimeFailed {
                run_id: id(),
                fence: fence().expect("fence"),
            },
            "demote" => {
                let c = contract(&format!(
                    "parallel:{}",
                    kv.get("to").expect("to=fp[:commit]")
                ));
                Command::Demote {
                    run_id: id(),
                    fence: fence().expect("fence"),
                    fingerprint: c.fingerprint,
                    commit: c.commit,
                }
            }
            "reserve" => Command::Reserve {
                scope: id(),
                owner: kv["owner"].clone(),
                operation_id: kv["op"].clone(),
                harness: kv["harness"].clone(),
            },
            "unreserve" => Command::Unreserve {
                scope: id(),
                owner: kv["owner"].clone(),
                operation_id: kv["op"].clone(),
            },
            "reconcile" => Command::Reconcile {
                scope: id(),
                owner: kv["owner"].clone(),
            },
            "control" => Command::ScopeControl {
                scope: id(),
                request_id: kv["id"].clone(),
                mode: kv["mode"].parse().expect("mode=pause|stop|resume"),
            },
            other => panic!("unknown verb {other}"),
        };
        let before = e.snapshot();
        let o = e.apply(now, cmd);
        for ev in &o.events {
            writeln!(out, "  {ev}").unwrap();
        }
        match &o.result {
            Ok(Some(v)) => show_view(&mut out, v),
            Ok(None) => {}
            Err(err) => {
                writeln!(out, "  ! {}: {err}", err.code()).unwrap();
                // A refused command changes nothing.
                let mut after = e.snapshot();
                after.now_ms = before.now_ms;
                if o.events.is_empty() {
                    assert_eq!(before, after, "refused command changed state: {line}");
                }
            }
        }
        if let Err(msg) = e.check_invariants() {
            panic!("invariant broken after `{line}`: {msg}\n{out}");
        }
    }
    out
}

#[test]
fn scenarios() {
    insta::glob!("scenarios/*.txt", |path| {
        let script = std::fs::read_to_string(path).unwrap();
        let trace = run_script(&script);
        insta::assert_snapshot!(trace);
    });
}

/// `12.50%` as hundredths of a percent.
fn percent_bp(text: &str) -> u32 {
    let t = text.strip_suffix('%').expect("a percentage like 12.50%");
    berth_core::validate::parse_hundredths(t).expect("a percentage like 12.50%")
}

/// Issue 36: a sample is taken whole. One whose MemAvailable rose while the memory
/// pressure rose grants nobody (the waiter stays, held back by the pressure); taken a
/// figure at a time, the rise alone would have granted it in between.
#[test]
fn a_sample_is_taken_whole() {
    let mut e = Engine::new(config(&BTreeMap::new()), 0).unwrap();
    let low = HostSample::memory(GIB);
    e.apply(0, Command::Sample(low));
    let kv: BTreeMap<String, String> = [("mem".to_string(), "2GiB".to_string())].into();
    e.apply(0, Command::Acquire(request("r", &kv, &[])));
    let reason = |e: &Engine| {
        e.view_of("r")
            .and_then(|v| v.reason)
            .map(|r| r.code.to_string())
    };
    assert_eq!(reason(&e).as_deref(), Some("capacity.memory"));
    // A rise is trusted after two samples; the second also says the host is stalling.
    e.apply(1_000, Command::Sample(HostSample::memory(8 * GIB)));
    let mut both = HostSample::memory(8 * GIB);
    both.pressure_bp[PressureKind::Memory.index()] = Some(5_000);
    let out = e.apply(2_000, Command::Sample(both));
    assert!(
        !out.events
            .iter()
            .any(|ev| matches!(ev, Event::Granted { .. })),
        "{:?}",
        out.events
    );
    assert_eq!(reason(&e).as_deref(), Some("host.memory_pressure"));
    e.check_invariants().unwrap();
}
