//! `berth-bench fanout` (issue 36): 32 agent-like runs on a host whose claims budget
//! is 2 GiB (64 MiB each, all admitted at once), 4 of which balloon far past their
//! claim (to 1 GiB, 16 MiB at a time). With limits enforced the kernel OOM-kills the 4
//! inside their own cgroups, and the other 28 finish. Reported: OOM kills on the host
//! outside berth's run groups (the kernel's `oom_kill` count over the run, less those
//! inside runs: must be 0), runs OOM-killed inside, and the well-behaved runs that
//! completed.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Instant;

use berth_client::wire::{AcquireRequest, ProcessRequest, ReleaseRequest, Run, Status, UniqueMap};

const RUNS: usize = 32;
const BALLOONING: usize = 4;
const CLAIM_BYTES: u64 = 64 << 20;
/// What a well-behaved run holds (an agent's working set, well inside its claim).
const WELL: &str = "import time\nb = b'x' * (32 << 20)\ntime.sleep(2)\n";
/// What a ballooning run does: grows 16 MiB every 20 ms up to 1 GiB.
const BALLOON: &str =
    "import time\nc = []\nfor i in range(64):\n    c.append(b'x' * (16 << 20))\n    time.sleep(0.02)\n";

pub fn main() {
    let dir = tempfile::tempdir().unwrap();
    let rt = crate::http::daemon_runtime();
    let mut cfg = crate::http::config(dir.path(), true);
    cfg.engine = berth_core::Config::for_host(64, RUNS as u64 * CLAIM_BYTES, 1 << 44);
    cfg.engine.memory_reserve = 0;
    cfg.engine.cpu_reserve_millis = 0;
    cfg.engine.disk_reserve = 0;
    cfg.engine.slots_max = RUNS as u64;
    let running = rt.block_on(berth_server::start(cfg)).expect("daemon");
    let url = format!("http://{}", running.addr);
    let auth = format!("Bearer {}", running.admin_token.clone().unwrap());
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let status: Status = agent
        .get(format!("{url}/v1/status"))
        .header("Authorization", &auth)
        .call()
        .unwrap()
        .into_body()
        .read_json()
        .unwrap();
    let oom_before = vmstat_oom_kills();
    let started = Instant::now();
    let outcomes: Vec<(bool, i32, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..RUNS)
            .map(|i| {
                let (agent, url, auth) = (agent.clone(), url.clone(), auth.clone());
                s.spawn(move || one_run(&agent, &url, &auth, i, i < BALLOONING))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let seconds = started.elapsed().as_secs_f64();
    let oom_after = vmstat_oom_kills();
    rt.block_on(running.stop()).unwrap();
    let inside: u64 = outcomes.iter().map(|o| o.2).sum();
    let killed = outcomes.iter().filter(|o| o.0 && o.2 > 0).count();
    let completed = outcomes.iter().filter(|o| !o.0 && o.1 == 0).count();
    let outside = match (oom_before, oom_after) {
        (Some(b), Some(a)) => (a - b).saturating_sub(inside).to_string(),
        _ => "null".into(),
    };
    println!(
        "{{\"bench\":\"fanout\",\"runs\":{RUNS},\"claim_mib\":{},\"claims_budget_mib\":{},\"ballooning\":{BALLOONING},\"limits\":{},\"host_oom_kills_outside_runs\":{outside},\"runs_oom_killed_inside\":{killed},\"well_behaved_completed\":{completed},\"well_behaved\":{},\"seconds\":{seconds:.1}}}",
        CLAIM_BYTES >> 20,
        (RUNS as u64 * CLAIM_BYTES) >> 20,
        serde_json::to_string(&status.limits.how.or(status.limits.why_not)).unwrap(),
        RUNS - BALLOONING,
    );
}

/// One run: acquired (granted at once: the budget fits all), its workload started
/// behind a gate, registered (so it is in the run's cgroup before it allocates),
/// let go, waited for and released. (ballooning, exit code, OOM kills inside it).
fn one_run(
    agent: &ureq::Agent,
    url: &str,
    auth: &str,
    i: usize,
    balloon: bool,
) -> (bool, i32, u64) {
    let id = format!("fan-{i}");
    let resources = [("memory", CLAIM_BYTES), ("cpu_millis", 500), ("disk", 0)];
    let body = AcquireRequest {
        run_id: Some(id.clone()),
        project: id.clone(),
        ttl_s: Some(300),
        resources: Some(UniqueMap(
            resources.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        )),
        ..Default::default()
    };
    let post = |path: String| {
        agent
            .post(format!("{url}{path}"))
            .header("Authorization", auth)
    };
    let run: Run = post("/v1/runs".into())
        .send_json(&body)
        .unwrap()
        .into_body()
        .read_json()
        .unwrap();
    let fence = run
        .fence
        .expect("granted at once: the claims budget fits every run");
    let code = if balloon { BALLOON } else { WELL };
    let mut child = Command::new("sh")
        .args(["-c", "read _ && exec python3 -c \"$0\"", code])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let reg = ProcessRequest {
        fence,
        pid: child.id() as i32,
    };
    post(format!("/v1/runs/{id}/processes"))
        .send_json(&reg)
        .unwrap();
    let _ = child.stdin.take().unwrap().write_all(b"go\n");
    let status = child.wait().unwrap();
    let released: Run = post(format!("/v1/runs/{id}/release"))
        .send_json(&ReleaseRequest { fence })
        .unwrap()
        .into_body()
        .read_json()
        .unwrap();
    let oom = released.usage.map_or(0, |u| u.oom_kills);
    (balloon, status.code().unwrap_or(-1), oom)
}

/// The kernel's count of OOM kills since boot (every one: host-wide and inside cgroups).
fn vmstat_oom_kills() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/vmstat").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
}
