//! `berth-bench fleet`: N daemons in fleet mode on one PostgreSQL database, driven by
//! the same lifecycle clients as `http` (spread over the hosts), with and without a
//! budget token in each claim; beside them, in the same run, the single-host SQLite
//! figure and pgbench doing a bare lifecycle (insert with a sequence, then delete)
//! against the same server with as many clients. The database is the one the
//! environment names (`PGHOST`, `PGPORT`, `PGUSER`, `PGPASSWORD`); `scripts/bench-fleet.sh`
//! starts a throwaway one with pg_virtualenv.

use crate::http::{config, drive, pct, Outcome};

/// A fleet run's figures, and how many claims and endings each round trip to the
/// store carried on average (issue 38 Build 1), from the hosts' `/metrics`.
fn fleet_run(hosts: usize, clients: usize, seconds: u64, budget: bool) -> (Outcome, f64, Vec<f64>) {
    rustix::fs::sync();
    let db = berth_store::fleet::testing::pg_fresh_database("bench").expect("a PostgreSQL server");
    let dirs: Vec<_> = (0..hosts).map(|_| tempfile::tempdir().unwrap()).collect();
    // A runtime per host, as each `berth serve` has its own: on one runtime (one worker
    // thread, `SERVE_WORKERS`) the three hosts' requests and steps queued behind each
    // other, which no fleet of separate daemons does.
    let rts: Vec<_> = (0..hosts).map(|_| crate::http::daemon_runtime()).collect();
    let running: Vec<_> = dirs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let mut cfg = config(d.path(), true);
            cfg.engine.fleet = true;
            cfg.fleet = Some(berth_server::fleet::FleetConfig {
                url: db.clone(),
                host: berth_server::fleet::HostInfo {
                    host_id: format!("bench-{i}"),
                    address: String::new(),
                    version: env!("CARGO_PKG_VERSION").into(),
                },
                beat_ms: 1_000,
                lapse_ms: cfg.engine.ttl_ms_max + 30_000,
                recheck_ms: 2_000,
                fence_floor: 0,
            });
            rts[i].block_on(berth_server::start(cfg)).expect("daemon")
        })
        .collect();
    let targets: Vec<(String, String)> = running
        .iter()
        .map(|r| {
            let url = format!("http://{}", r.addr);
            (url, format!("Bearer {}", r.admin_token.clone().unwrap()))
        })
        .collect();
    let commits = || running.iter().map(|r| r.commits()).sum();
    let out = drive(targets.clone(), clients, 0, seconds, budget, &commits);
    let (mut ops, mut trips) = (0.0, 0.0);
    for (url, auth) in &targets {
        let (o, t) = batch_ops(url, auth);
        (ops, trips) = (ops + o, trips + t);
    }
    let wakes = match (budget, &targets[..]) {
        (false, [a, b, ..]) => wake_ms(a, b, WAKE_TRIALS),
        _ => Vec::new(),
    };
    for (r, rt) in running.into_iter().zip(&rts) {
        rt.block_on(r.stop()).unwrap();
    }
    (out, ops / trips.max(1.0), wakes)
}

/// floor-fleet (`floor.rs`) on `hosts` hosts against a fresh database of the same
/// server, driven by the same clients: what any fleet built on this HTTP stack, W1's
/// two renames and one group-committed claim and ending per lifecycle could reach on
/// this machine, with no ledger, no engine and no journal; with `ledger`,
/// floor-fleet-ledger: the same plus each run's record durable in berth's own ledger at
/// its grant and its release, the least any durable host writes.
fn floor_run(hosts: usize, clients: usize, seconds: u64, ledger: bool) -> Outcome {
    rustix::fs::sync();
    let db = berth_store::fleet::testing::pg_fresh_database("floor").expect("a PostgreSQL server");
    let dirs: Vec<_> = (0..hosts).map(|_| tempfile::tempdir().unwrap()).collect();
    let rts: Vec<_> = (0..hosts).map(|_| crate::http::daemon_runtime()).collect();
    let targets = (0..hosts)
        .map(|i| {
            let id = format!("floor-{i}");
            let addr = crate::floor::fleet_host(&rts[i], &db, &id, dirs[i].path(), ledger)
                .expect("a floor-fleet host");
            (format!("http://{addr}"), "Bearer floor".to_string())
        })
        .collect();
    drive(targets, clients, 0, seconds, false, &|| 0)
}

/// Trials of the cross-host wake-up (issue 38 asks for at least 100).
const WAKE_TRIALS: usize = 100;

/// Issue 38's wake-up: a waiter on host `b` for a fleet-wide key that a run on host `a`
/// holds, granted once `a` releases it (the ending at the store, PostgreSQL's NOTIFY,
/// `b`'s listener, its claim and its grant). Each trial's time runs from the release
/// request to `b`'s long poll answering the grant. In milliseconds, in trial order.
fn wake_ms(a: &(String, String), b: &(String, String), trials: usize) -> Vec<f64> {
    use serde_json::{json, Value};
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let call = |(url, auth): &(String, String), path: &str, body: Option<Value>| -> Value {
        let url = format!("{url}{path}");
        let resp = match body {
            Some(b) => agent.post(url).header("Authorization", auth).send_json(b),
            None => agent.get(url).header("Authorization", auth).call(),
        };
        let text = resp
            .expect("an answer")
            .body_mut()
            .read_to_string()
            .unwrap();
        serde_json::from_str(&text).unwrap_or(Value::Null)
    };
    let acquire = |host, run: &str, wait_s: u64| {
        let body = json!({"run_id": run, "project": format!("wake-{run}"), "wait_s": wait_s,
            "detach": true, "singletons": ["fleet:bench-wake"],
            "resources": {"slots": 1, "memory": 1 << 20, "cpu_millis": 1, "disk": 0}});
        call(host, "/v1/runs", Some(body))
    };
    // The run's fence once it is granted (long polls while it waits).
    let granted = |host, run: &str, first: Value| {
        let (mut now, since) = (first, std::time::Instant::now());
        loop {
            match now["state"].as_str() {
                Some("granted") => return now["fence"].as_u64().unwrap(),
                Some("queued") if since.elapsed().as_secs() < 30 => {}
                _ => panic!("{run} was not granted: {now}"),
            }
            now = call(host, &format!("/v1/runs/{run}?wait_s=5&state=queued"), None);
        }
    };
    let release = |host, run: &str, fence: u64| {
        call(
            host,
            &format!("/v1/runs/{run}/release"),
            Some(json!({ "fence": fence })),
        )
    };
    let mut out = Vec::with_capacity(trials);
    for i in 0..trials {
        let (holder, waiter) = (format!("wake-a-{i}"), format!("wake-b-{i}"));
        // The last trial's ending reaches the store just after its release's answer:
        // the holder may wait for it a moment.
        let held = granted(a, &holder, acquire(a, &holder, 30));
        let queued = acquire(b, &waiter, 30);
        assert_eq!(queued["state"], "queued", "{queued}");
        let started = std::time::Instant::now();
        release(a, &holder, held);
        let fence = granted(b, &waiter, queued);
        out.push(started.elapsed().as_secs_f64() * 1e3);
        release(b, &waiter, fence);
    }
    out
}

/// A host's `berth_fleet_batch_ops` histogram: its sum (ops carried out) and count
/// (round trips).
fn batch_ops(url: &str, auth: &str) -> (f64, f64) {
    let text = ureq::get(format!("{url}/metrics"))
        .header("Authorization", auth)
        .call()
        .expect("GET /metrics")
        .body_mut()
        .read_to_string()
        .expect("the metrics' text");
    let value = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (
        value("berth_fleet_batch_ops_sum "),
        value("berth_fleet_batch_ops_count "),
    )
}

/// pgbench's lifecycle: a row with the next sequence value, then its delete, each
/// committed (what a fleet claim and its ending cost the database at the least): its
/// rate, and the machine's busy CPU per lifecycle in microseconds (pgbench itself and
/// the server's connection setup included).
fn pgbench(clients: usize, seconds: u64) -> Result<(f64, u64), String> {
    let db = berth_store::fleet::testing::pg_fresh_database("pgbench")?;
    let name = db
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("dbname="))
        .ok_or("no database name")?
        .to_owned();
    berth_store::fleet::testing::pg_execute(
        &db,
        "CREATE SEQUENCE lifecycle_seq; CREATE TABLE lifecycle (id bigint PRIMARY KEY);",
    )?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let script = dir.path().join("lifecycle.sql");
    std::fs::write(
        &script,
        "INSERT INTO lifecycle VALUES (nextval('lifecycle_seq')) RETURNING id \\gset\n\
         DELETE FROM lifecycle WHERE id = :id;\n",
    )
    .map_err(|e| e.to_string())?;
    let before = crate::cpu::Cpu::now();
    let out = std::process::Command::new("pgbench")
        .args([
            "-n",
            "-c",
            &clients.to_string(),
            "-j",
            "2",
            "-T",
            &seconds.to_string(),
        ])
        .arg("-f")
        .arg(&script)
        .arg(&name)
        .output()
        .map_err(|e| format!("pgbench: {e}"))?;
    let after = crate::cpu::Cpu::now();
    let text = String::from_utf8_lossy(&out.stdout);
    let tps: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| {
            format!(
                "pgbench said: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    let done = (tps * seconds as f64) as u64;
    Ok((tps, after.per(&before, done).machine_us))
}

pub fn main(hosts: usize, clients: usize, seconds: u64) {
    let (plain, per_trip, mut wakes) = fleet_run(hosts, clients, seconds, false);
    let (token, _, _) = fleet_run(hosts, clients, seconds, true);
    wakes.sort_by(f64::total_cmp);
    let single = crate::http::run(clients, 0, seconds, true);
    let floor = floor_run(hosts, clients, seconds, false);
    let floor_ledger = floor_run(hosts, clients, seconds, true);
    let (pg, pg_cpu_us) = pgbench(clients, seconds).unwrap_or_else(|e| {
        eprintln!("pgbench: {e}");
        (0.0, 0)
    });
    let rate = |o: &Outcome| o.lifecycles as f64 / o.seconds;
    // Whether the server syncs its commits (pg_virtualenv turns fsync off unless told).
    let fsync = berth_store::fleet::testing::pg_setting("fsync").unwrap_or_else(|e| e);
    println!(
        "{{\"hosts\":{hosts},\"pg_fsync\":\"{fsync}\",\"clients\":{clients},\"seconds\":{seconds},\"fleet_lifecycles_per_s\":{:.0},\"fleet_grant_p50_ms\":{:.3},\"fleet_grant_p99_ms\":{:.3},\"fleet_ops_per_round_trip\":{per_trip:.2},\"fleet_ledger_commits_per_lifecycle\":{:.2},\"fleet_wake_trials\":{},\"fleet_wake_p50_ms\":{:.3},\"fleet_wake_p99_ms\":{:.3},\"fleet_with_budget_token_lifecycles_per_s\":{:.0},\"fleet_with_budget_token_grant_p99_ms\":{:.3},\"single_host_sqlite_lifecycles_per_s\":{:.0},\"single_host_ledger_commits_per_lifecycle\":{:.2},\"pgbench_lifecycles_per_s\":{pg:.0},\"floor_fleet_lifecycles_per_s\":{:.0},\"floor_fleet_grant_p50_ms\":{:.3},\"floor_fleet_machine_cpu_us_per_lifecycle\":{},\"floor_fleet_ledger_lifecycles_per_s\":{:.0},\"floor_fleet_ledger_grant_p50_ms\":{:.3},\"floor_fleet_ledger_machine_cpu_us_per_lifecycle\":{},\"floor_fleet_ledger_threads_cpu_us_per_lifecycle\":{},\"fleet_machine_cpu_us_per_lifecycle\":{},\"fleet_machine_steal_us_per_lifecycle\":{},\"fleet_daemons_cpu_us_per_lifecycle\":{},\"fleet_postgres_cpu_us_per_lifecycle\":{},\"fleet_daemon_threads_cpu_us_per_lifecycle\":{},\"single_host_machine_cpu_us_per_lifecycle\":{},\"single_host_daemon_threads_cpu_us_per_lifecycle\":{},\"pgbench_machine_cpu_us_per_lifecycle\":{pg_cpu_us},\"errors\":{}}}",
        rate(&plain),
        pct(&plain.grant_ms, 0.5),
        pct(&plain.grant_ms, 0.99),
        plain.commits as f64 / plain.lifecycles.max(1) as f64,
        wakes.len(),
        pct(&wakes, 0.5),
        pct(&wakes, 0.99),
        rate(&token),
        pct(&token.grant_ms, 0.99),
        rate(&single),
        single.commits as f64 / single.lifecycles.max(1) as f64,
        rate(&floor),
        pct(&floor.grant_ms, 0.5),
        floor.cpu.machine_us,
        rate(&floor_ledger),
        pct(&floor_ledger.grant_ms, 0.5),
        floor_ledger.cpu.machine_us,
        floor_ledger.cpu.by_thread_json(),
        plain.cpu.machine_us,
        plain.cpu.steal_us,
        plain.cpu.daemons_us,
        plain.cpu.postgres_us,
        plain.cpu.by_thread_json(),
        single.cpu.machine_us,
        single.cpu.by_thread_json(),
        plain.errors + token.errors + single.errors + floor.errors + floor_ledger.errors,
    );
}
