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
    let rt = crate::http::daemon_runtime();
    // Long enough that no lease runs out while the runs are being set up (the first
    // daemon would reap those itself), short enough to keep the benchmark quick.
    let ttl_s = (runs as u64 / 100 + 5).max(2);
    let created = Instant::now();
    let first = rt
        .block_on(berth_server::start(crate::http::config(dir.path(), true)))
        .expect("daemon");
    let b = Bench {
        url: format!("http://{}", first.addr),
        auth: format!("Bearer {}", first.admin_token.clone().unwrap()),
        agent: ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into(),
    };
    let mut children: Vec<Child> = (0..runs).map(|i| b.run_with_a_tree(i, ttl_s)).collect();
    rt.block_on(first.stop()).unwrap();
    // Every lease runs out while the daemon is down.
    std::thread::sleep(Duration::from_secs(ttl_s + 1).saturating_sub(created.elapsed()));

    let started = Instant::now();
    let second = rt
        .block_on(berth_server::start(crate::http::config(dir.path(), true)))
        .expect("restart");
    let b = Bench {
        url: format!("http://{}", second.addr),
        ..b
    };
    let serving = loop {
        let r = b.get("/v1/status");
        if matches!(r, Ok(ref r) if r.status().as_u16() == 200) {
            break started.elapsed();
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let (reap, status) = b.wait_until_clean(dir.path(), runs, &mut children, started);
    rt.block_on(second.stop()).unwrap();
    println!(
        "{{\"runs\":{runs},\"reap_seconds\":{:.2},\"processes_terminated\":{},\"diagnostics_bytes\":{},\"startup_to_serving_ms\":{}}}",
        reap.as_secs_f64(),
        status.reaper.processes_terminated,
        status.reaper.diagnostics_bytes,
        serving.as_millis()
    );
}

/// The daemon under test, as the benchmark's client sees it.
struct Bench {
    url: String,
    auth: String,
    agent: ureq::Agent,
}

impl Bench {
    fn get(&self, path: &str) -> Result<ureq::http::Response<ureq::Body>, ureq::Error> {
        let url = format!("{}{path}", self.url);
        self.agent
            .get(url)
            .header("Authorization", &self.auth)
            .call()
    }

    /// Run `rec-{i}`, granted, with a few KiB of logs and a small registered tree (a
    /// shell with a child).
    fn run_with_a_tree(&self, i: usize, ttl_s: u64) -> Child {
        let id = format!("rec-{i}");
        // Enough for its shell and sleep: a claim is also a cgroup limit (issue 36).
        let resources = [("memory", 16 << 20), ("cpu_millis", 10), ("disk", 0)];
        let body = AcquireRequest {
            run_id: Some(id.clone()),
            project: format!("p{i}"),
            ttl_s: Some(ttl_s),
            resources: Some(UniqueMap(
                resources.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            )),
            ..Default::default()
        };
        let r = self
            .agent
            .post(format!("{}/v1/runs", self.url))
            .header("Authorization", &self.auth)
            .send_json(&body)
            .unwrap();
        let v: Run = r.into_body().read_json().unwrap();
        let fence = v.fence.expect("granted");
        let ws = v.workspace.expect("a workspace");
        std::fs::write(format!("{ws}/logs/run.log"), vec![b'l'; 3 * 1024]).unwrap();
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
        self.agent
            .post(format!("{}/v1/runs/{id}/processes", self.url))
            .header("Authorization", &self.auth)
            .send_json(&reg)
            .unwrap();
        child
    }

    /// Until every run has ended, every tree is gone, every workspace removed and every
    /// log archived: how long that took, and the daemon's status then.
    fn wait_until_clean(
        &self,
        state: &std::path::Path,
        runs: usize,
        children: &mut Vec<Child>,
        started: Instant,
    ) -> (Duration, Status) {
        let count = |p: std::path::PathBuf, hidden: bool| {
            std::fs::read_dir(p).map_or(0, |rd| {
                rd.filter_map(|e| e.ok())
                    .filter(|e| hidden || !e.file_name().to_string_lossy().starts_with('.'))
                    .count()
            })
        };
        loop {
            let s: Status = self
                .get("/v1/status")
                .unwrap()
                .into_body()
                .read_json()
                .unwrap();
            let live = s.granted + s.releasing + s.degraded;
            children.retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_))));
            let workspaces = count(state.join("runs"), false);
            let trash = count(state.join("runs/.trash"), true);
            let archives = count(state.join("diagnostics"), true);
            if live == 0 && children.is_empty() && workspaces == 0 && trash == 0 && archives >= runs
            {
                return (started.elapsed(), s);
            }
            if started.elapsed() > Duration::from_secs(300) {
                panic!("not done after 300 s: live {live}, children {}, workspaces {workspaces}, trash {trash}, archives {archives}", children.len());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
