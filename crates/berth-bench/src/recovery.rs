//! `berth-bench recovery --runs N`: N granted runs, each with a small live process tree
//! and a few KiB of logs, all expired while the daemon is down; then the daemon starts
//! again and we time until every tree is stopped, every log archived and every
//! workspace removed, and how soon the daemon answers requests meanwhile.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use berth_client::wire::{AcquireRequest, ProcessRequest, Run, Status, UniqueMap};

pub fn main(runs: usize) {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // Long enough that no lease runs out while the runs are being set up (the first
    // daemon would reap those itself), short enough to keep the benchmark quick.
    let ttl_s = (runs as u64 / 100 + 5).max(2);
    let created = Instant::now();
    let first = rt
        .block_on(berth_server::start(crate::http::config(dir.path(), true)))
        .expect("daemon");
    let url = format!("http://{}", first.addr);
    let auth = format!("Bearer {}", first.admin_token.clone().unwrap());
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let mut children: Vec<Child> = Vec::new();
    for i in 0..runs {
        let id = format!("rec-{i}");
        let resources = [("memory", 1 << 20), ("cpu_millis", 1), ("disk", 0)];
        let body = AcquireRequest {
            run_id: Some(id.clone()),
            project: format!("p{i}"),
            ttl_s: Some(ttl_s),
            resources: Some(UniqueMap(
                resources.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            )),
            ..Default::default()
        };
        let r = agent
            .post(format!("{url}/v1/runs"))
            .header("Authorization", &auth)
            .send_json(&body)
            .unwrap();
        let v: Run = r.into_body().read_json().unwrap();
        let fence = v.fence.expect("granted");
        let ws = v.workspace.expect("a workspace");
        std::fs::write(format!("{ws}/logs/run.log"), vec![b'l'; 3 * 1024]).unwrap();
        // A small tree: a shell with a child.
        let child = Command::new("sh")
            .args(["-c", "sleep 600 & exec sleep 600"])
            .process_group(0)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let reg = ProcessRequest {
            fence,
            pid: child.id() as i32,
        };
        agent
            .post(format!("{url}/v1/runs/{id}/processes"))
            .header("Authorization", &auth)
            .send_json(&reg)
            .unwrap();
        children.push(child);
    }
    rt.block_on(first.stop()).unwrap();
    // Every lease runs out while the daemon is down.
    std::thread::sleep(Duration::from_secs(ttl_s + 1).saturating_sub(created.elapsed()));

    let started = Instant::now();
    let second = rt
        .block_on(berth_server::start(crate::http::config(dir.path(), true)))
        .expect("restart");
    let url = format!("http://{}", second.addr);
    let serving = loop {
        let r = agent
            .get(format!("{url}/v1/status"))
            .header("Authorization", &auth)
            .call();
        if matches!(r, Ok(ref r) if r.status().as_u16() == 200) {
            break started.elapsed();
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let runs_dir = dir.path().join("runs");
    let diag_dir = dir.path().join("diagnostics");
    let (reap, status) = loop {
        let s: Status = agent
            .get(format!("{url}/v1/status"))
            .header("Authorization", &auth)
            .call()
            .unwrap()
            .into_body()
            .read_json()
            .unwrap();
        let live = s.granted + s.releasing + s.degraded;
        children.retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_))));
        let workspaces = std::fs::read_dir(&runs_dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
                    .count()
            })
            .unwrap_or(0);
        let trash = std::fs::read_dir(runs_dir.join(".trash"))
            .map(|rd| rd.count())
            .unwrap_or(0);
        let archives = std::fs::read_dir(&diag_dir)
            .map(|rd| rd.count())
            .unwrap_or(0);
        if live == 0 && children.is_empty() && workspaces == 0 && trash == 0 && archives >= runs {
            break (started.elapsed(), s);
        }
        if started.elapsed() > Duration::from_secs(300) {
            panic!("not done after 300 s: live {live}, children {}, workspaces {workspaces}, trash {trash}, archives {archives}", children.len());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    rt.block_on(second.stop()).unwrap();
    println!(
        "{{\"runs\":{runs},\"reap_seconds\":{:.2},\"processes_terminated\":{},\"diagnostics_bytes\":{},\"startup_to_serving_ms\":{}}}",
        reap.as_secs_f64(),
        status.reaper.processes_terminated,
        status.reaper.diagnostics_bytes,
        serving.as_millis()
    );
}
