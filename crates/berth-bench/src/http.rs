//! `berth-bench http`: acquire -> release lifecycles from N concurrent HTTP clients
//! against a daemon on a temporary SQLite ledger with durability on; then the same
//! workload against a daemon whose ledger commits every write on its own (baseline).
//! With `--subscribers N`, N clients follow `GET /v1/events` (SSE) throughout, as
//! dashboards and orchestrators do, and the events each received are counted: the
//! journal's cost to the request path is measured with its readers attached.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Load before the measurement starts.
const WARMUP: Duration = Duration::from_secs(2);

pub(crate) struct Outcome {
    pub(crate) lifecycles: u64,
    pub(crate) seconds: f64,
    pub(crate) grant_ms: Vec<f64>,
    pub(crate) commits: u64,
    pub(crate) errors: u64,
    /// Events each subscriber received while measuring.
    events: Vec<u64>,
    /// Subscribers the daemon cut off for falling behind.
    cutoffs: u64,
    /// CPU per lifecycle while measuring (`crate::cpu`).
    pub(crate) cpu: crate::cpu::Cpu,
}

/// A daemon with room for everything the benchmarks ask (slots, memory, disk), durable
/// ledger on, memory sampling off.
pub fn config(state: &std::path::Path, group_commit: bool) -> berth_server::ServeConfig {
    let mut engine = berth_core::Config::for_host(64, 1 << 40, 1 << 44);
    engine.slots_max = 4096;
    engine.memory_reserve = 0;
    engine.cpu_reserve_millis = 0;
    engine.disk_reserve = 0;
    berth_server::ServeConfig {
        state_dir: state.to_path_buf(),
        listen: "127.0.0.1:0".parse().unwrap(),
        insecure_no_auth: false,
        engine,
        sample_memory: false,
        pressure_source: None,
        cpu_pressure_source: None,
        io_pressure_source: None,
        reconnect_window_ms: 30_000,
        group_commit,
        tick_ms: 100,
        stop_grace_ms: 10_000,
        cgroups: true,
        limits: Default::default(),
        diagnostics_run_bytes_max: 1 << 20,
        diagnostics_total_bytes_max: 1 << 30,
        init_ledger: false,
        fence_reserve_block: berth_server::private::FENCE_RESERVE_BLOCK,
        user_workspaces: None,
        retain_ended_for_ms: berth_server::RETAIN_ENDED_FOR_MS_DEFAULT,
        token_streams_max: berth_server::limits::TOKEN_STREAMS_MAX_DEFAULT,
        token_waits_max: berth_server::limits::TOKEN_WAITS_MAX_DEFAULT,
        port_range: berth_server::PORT_RANGE_DEFAULT,
        threads: Default::default(),
        fleet: None,
    }
}

/// The runtime an embedded daemon runs on in the benchmarks: `berth serve`'s.
pub fn daemon_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(berth_server::SERVE_WORKERS)
        .enable_all()
        .build()
        .unwrap()
}

pub(crate) fn run(clients: usize, subscribers: usize, seconds: u64, group_commit: bool) -> Outcome {
    // Whatever ran before (a build, the other half of this benchmark) leaves dirty pages
    // whose writeback would compete with the daemon's fsyncs: flush them first.
    rustix::fs::sync();
    let dir = tempfile::tempdir().unwrap();
    let rt = crate::http::daemon_runtime();
    let running = rt
        .block_on(berth_server::start(config(dir.path(), group_commit)))
        .expect("daemon");
    let hosts = vec![(
        format!("http://{}", running.addr),
        format!("Bearer {}", running.admin_token.clone().unwrap()),
    )];
    let commits = || running.commits();
    let out = drive(hosts, clients, subscribers, seconds, false, &commits);
    rt.block_on(running.stop()).unwrap();
    out
}

/// `clients` lifecycles in a loop against `hosts` (and `subscribers` following the
/// first host's events) for WARMUP, then `seconds` measured. `commits` reads the
/// ledger commits so far.
pub(crate) fn drive(
    hosts: Vec<(String, String)>,
    clients: usize,
    subscribers: usize,
    seconds: u64,
    budget: bool,
    commits: &dyn Fn() -> u64,
) -> Outcome {
    // Steady state is what is measured: the clients first run for WARMUP (the
    // daemon's workspace pool fills, connections open), then the counting starts.
    let load = Arc::new(Load {
        hosts,
        budget,
        measuring: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        count: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        grant_ms: Mutex::new(Vec::new()),
        events: (0..subscribers).map(|_| AtomicU64::new(0)).collect(),
        cutoffs: AtomicU64::new(0),
    });
    let clients_thread = spawn_clients(load.clone(), clients, subscribers);
    std::thread::sleep(WARMUP);
    let commits_before = commits();
    let (started, cpu_before) = (Instant::now(), crate::cpu::Cpu::now());
    load.measuring.store(true, Ordering::Relaxed);
    std::thread::sleep(Duration::from_secs(seconds));
    let cpu = crate::cpu::Cpu::now().per(&cpu_before, load.count.load(Ordering::Relaxed));
    let secs = started.elapsed().as_secs_f64();
    let commits = commits() - commits_before;
    load.stop.store(true, Ordering::Relaxed);
    clients_thread.join().unwrap();
    let mut grant_ms = std::mem::take(&mut *load.grant_ms.lock().unwrap());
    grant_ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Outcome {
        lifecycles: load.count.load(Ordering::Relaxed),
        seconds: secs,
        grant_ms,
        commits,
        errors: load.errors.load(Ordering::Relaxed),
        events: load
            .events
            .iter()
            .map(|e| e.load(Ordering::Relaxed))
            .collect(),
        cutoffs: load.cutoffs.load(Ordering::Relaxed),
        cpu,
    }
}

/// The load generator shares the machine's two cores with the daemon, so it must cost
/// little: the clients are tasks on one thread (epoll, as wrk does), each with its own
/// keep-alive connection, not one blocked OS thread per client.
fn spawn_clients(
    load: Arc<Load>,
    clients: usize,
    subscribers: usize,
) -> std::thread::JoinHandle<()> {
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    std::thread::spawn(move || {
        client_rt.block_on(async move {
            // Subscribers first, so that every lifecycle's events reach them.
            let subs: Vec<_> = (0..subscribers)
                .map(|s| tokio::spawn(subscriber(s, load.clone())))
                .collect();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let tasks: Vec<_> = (0..clients)
                .map(|c| tokio::spawn(client(c, load.clone())))
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
            for s in subs {
                s.abort();
            }
        })
    })
}

pub(crate) fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

pub fn main(clients: usize, subscribers: usize, seconds: u64) {
    let grouped = run(clients, subscribers, seconds, true);
    let baseline = run(clients, subscribers, seconds, false);
    let rate = grouped.lifecycles as f64 / grouped.seconds;
    let base_rate = baseline.lifecycles as f64 / baseline.seconds;
    // Each lifecycle journals at least `queued`, `granted`, `released` and `ended`.
    let events_min = grouped.events.iter().min().copied().unwrap_or(0) as f64;
    let events_mean =
        grouped.events.iter().sum::<u64>() as f64 / grouped.events.len().max(1) as f64;
    println!(
        "{{\"clients\":{clients},\"subscribers\":{subscribers},\"seconds\":{seconds},\"lifecycles\":{},\"lifecycles_per_s\":{rate:.0},\"grant_p50_ms\":{:.3},\"grant_p99_ms\":{:.3},\"commits_per_lifecycle\":{:.3},\"errors\":{},\"baseline_lifecycles_per_s\":{base_rate:.0},\"baseline_commits_per_lifecycle\":{:.3},\"speedup\":{:.2},\"events_per_s_per_subscriber_mean\":{:.0},\"events_per_s_per_subscriber_min\":{:.0},\"subscribers_cut_off\":{}}}",
        grouped.lifecycles,
        pct(&grouped.grant_ms, 0.5),
        pct(&grouped.grant_ms, 0.99),
        grouped.commits as f64 / grouped.lifecycles.max(1) as f64,
        grouped.errors + baseline.errors,
        baseline.commits as f64 / baseline.lifecycles.max(1) as f64,
        rate / base_rate.max(1e-9),
        events_mean / grouped.seconds,
        events_min / grouped.seconds,
        grouped.cutoffs + baseline.cutoffs,
    );
}

/// What the clients share: where to go, when to count and stop, and the tallies.
pub(crate) struct Load {
    /// The daemons' URLs and bearer headers: client `c` talks to `hosts[c % len]`.
    hosts: Vec<(String, String)>,
    /// Each acquire carries a budget token (fleet benchmark).
    budget: bool,
    measuring: AtomicBool,
    stop: AtomicBool,
    count: AtomicU64,
    errors: AtomicU64,
    grant_ms: Mutex<Vec<f64>>,
    /// Per subscriber: events received while measuring.
    events: Vec<AtomicU64>,
    cutoffs: AtomicU64,
}

/// The load generator's acquire body, written by hand: the client shares the machine's
/// cores with the daemon, so it spends as little as it can per request. A unit test
/// keeps it what API v1's `AcquireRequest` says.
pub(crate) fn acquire_body(c: usize, id: &str, budget: bool) -> String {
    // A limit no load here reaches: the token's cost is measured, not a wait for one.
    let budget = if budget {
        r#","budget":{"scope":"bench","harness":"h","per_harness":{"h":1024}}"#
    } else {
        ""
    };
    format!(
        r#"{{"run_id":"{id}","project":"bench-{c}","resources":{{"memory":1048576,"cpu_millis":1,"disk":0}}{budget}}}"#
    )
}

/// The release body, by hand like `acquire_body`.
pub(crate) fn release_body(fence: u64) -> String {
    format!(r#"{{"fence":{fence}}}"#)
}

/// One client: acquire -> release lifecycles until `stop`.
async fn client(c: usize, load: Arc<Load>) {
    let (url, token) = &load.hosts[c % load.hosts.len()];
    let (url, token) = (url.as_str(), token.as_str());
    let (measuring, stop, count, errors) = (&load.measuring, &load.stop, &load.count, &load.errors);
    let mut conn = Conn::open(url).await;
    let mut mine = Vec::new();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let id = format!("c{c}-{i}");
        let body = acquire_body(c, &id, load.budget);
        let t = Instant::now();
        let Some((status, resp)) = conn.post("/v1/runs", token, &body).await else {
            errors.fetch_add(1, Ordering::Relaxed);
            conn = Conn::open(url).await;
            continue;
        };
        let counted = measuring.load(Ordering::Relaxed);
        if counted {
            mine.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        if status != 201 {
            errors.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let fence = field_u64(&resp, "\"fence\":").unwrap_or(0);
        let release = release_body(fence);
        let path = format!("/v1/runs/{id}/release");
        let mut released = conn.post(&path, token, &release).await;
        if released.is_none() {
            // An acquire that queued first is answered with `connection: close` (a
            // fleet host's runs always do, while their claim is taken): reconnect.
            conn = Conn::open(url).await;
            released = conn.post(&path, token, &release).await;
        }
        match released {
            Some((200, _)) => {
                if counted {
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }
            _ => {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    load.grant_ms.lock().unwrap().extend(mine);
}

/// One subscriber: follows `GET /v1/events` from now on and counts the events (records
/// with an `id:`) it receives while measuring, until aborted or cut off.
async fn subscriber(s: usize, load: Arc<Load>) {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let mut conn = Conn::open(&load.hosts[0].0).await;
    let req = format!(
        "GET /v1/events HTTP/1.1\r\nHost: {}\r\nAuthorization: {}\r\nAccept: text/event-stream\r\n\r\n",
        conn.host, load.hosts[0].1
    );
    conn.stream
        .get_mut()
        .write_all(req.as_bytes())
        .await
        .unwrap();
    let mut line = String::new();
    // The head: a 200, then (chunked) the stream.
    loop {
        line.clear();
        if conn.stream.read_line(&mut line).await.unwrap_or(0) == 0 {
            return;
        }
        if line.trim_end().is_empty() {
            break;
        }
    }
    // Undo the chunked encoding and count the records. Cheaply: the load generator
    // shares the two cores with the daemon, and eight readers receive some 70 MB/s.
    // This stream is unfiltered, so ids are consecutive and a chunk's records are the
    // distance from the last id seen to the last `id:` in the chunk, found from its end.
    const RECORD: &[u8] = b"\nid: ";
    let mut chunk = Vec::new();
    let mut last_id: Option<u64> = None;
    loop {
        line.clear();
        let len = match conn.stream.read_line(&mut line).await {
            Ok(n) if n > 0 => usize::from_str_radix(line.trim_end(), 16).unwrap_or(0),
            _ => 0,
        };
        // One byte before the chunk stands for the line end that precedes each record.
        chunk.resize(len + 3, 0);
        chunk[0] = b'\n';
        if len == 0 || conn.stream.read_exact(&mut chunk[1..]).await.is_err() {
            // The daemon ended the stream: only a cutoff does that while it runs.
            if !load.stop.load(Ordering::Relaxed) {
                load.cutoffs.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        let body = &chunk[..=len];
        let Some(at) = (0..body.len().saturating_sub(RECORD.len() - 1))
            .rev()
            .find(|&k| body[k..].starts_with(RECORD))
        else {
            continue; // a heartbeat
        };
        let digits = body[at + RECORD.len()..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .fold(0u64, |n, b| n * 10 + u64::from(b - b'0'));
        if let Some(before) = last_id {
            if load.measuring.load(Ordering::Relaxed) {
                load.events[s].fetch_add(digits.saturating_sub(before), Ordering::Relaxed);
            }
        }
        last_id = Some(digits);
    }
}

/// One keep-alive HTTP/1.1 connection to the daemon.
pub(crate) struct Conn {
    stream: tokio::io::BufReader<tokio::net::TcpStream>,
    host: String,
}

impl Conn {
    pub(crate) async fn open(url: &str) -> Conn {
        let host = url.trim_start_matches("http://").to_string();
        let stream = tokio::net::TcpStream::connect(&host)
            .await
            .expect("connect");
        stream.set_nodelay(true).ok();
        Conn {
            stream: tokio::io::BufReader::new(stream),
            host,
        }
    }

    /// POSTs `body` and returns (status, response body), or None if the connection broke.
    pub(crate) async fn post(
        &mut self,
        path: &str,
        auth: &str,
        body: &str,
    ) -> Option<(u16, String)> {
        self.request("POST", path, auth, body).await
    }

    /// One request; (status, response body), or None if the connection broke.
    pub(crate) async fn request(
        &mut self,
        method: &str,
        path: &str,
        auth: &str,
        body: &str,
    ) -> Option<(u16, String)> {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        // (An empty `auth` sends no Authorization header: etcd's gateway is asked too.)
        let auth = if auth.is_empty() {
            String::new()
        } else {
            format!("Authorization: {auth}\r\n")
        };
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.host,
            body.len()
        );
        self.stream.get_mut().write_all(req.as_bytes()).await.ok()?;
        let mut line = String::new();
        self.stream.read_line(&mut line).await.ok()?;
        let status: u16 = line.split_whitespace().nth(1)?.parse().ok()?;
        let mut len = 0usize;
        loop {
            line.clear();
            self.stream.read_line(&mut line).await.ok()?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().ok()?;
                }
            }
        }
        let mut buf = vec![0u8; len];
        self.stream.read_exact(&mut buf).await.ok()?;
        Some((status, String::from_utf8(buf).ok()?))
    }
}

pub(crate) fn field_u64(json: &str, key: &str) -> Option<u64> {
    let at = json.find(key)? + key.len();
    let digits: String = json[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use berth_client::wire::{AcquireRequest, ReleaseRequest};

    #[test]
    fn the_hand_written_bodies_are_api_v1() {
        let a: AcquireRequest =
            serde_json::from_str(&super::acquire_body(3, "c3-9", false)).unwrap();
        assert_eq!(a.run_id.as_deref(), Some("c3-9"));
        assert_eq!(a.project, "bench-3");
        assert_eq!(a.resources.unwrap().0["memory"], 1 << 20);
        assert!(a.budget.is_none());
        let b: AcquireRequest =
            serde_json::from_str(&super::acquire_body(3, "c3-9", true)).unwrap();
        assert_eq!(b.budget.unwrap().harness, "h");
        let r: ReleaseRequest = serde_json::from_str(&super::release_body(42)).unwrap();
        assert_eq!(r.fence, 42);
        // The answer's fence is found where the server writes it.
        let run = r#"{"claim":{"keys":[],"resources":{}},"fence":17,"labels":{}}"#;
        assert_eq!(super::field_u64(run, "\"fence\":"), Some(17));
    }
}
