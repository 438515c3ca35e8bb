//! `berth-bench waiters --attached N --detached M`: what a deep queue costs a real
//! daemon (issue 18). The daemon runs in its own process (its RSS, CPU time and
//! descriptors are its own) on a one-slot host, and one lease holds the slot. Then:
//!   1. M detached waiters (`detach: true`) join the queue: RSS per waiter; the idle
//!      daemon's CPU over 10 s with nothing changing; release -> next grant latency
//!      with the queue full (the next waiter is followed by `GET ?wait_s=`).
//!   2. N attached waiters (long polls, each on its own connection, never read) join
//!      behind them: RSS per waiter, idle CPU over 10 s, descriptors used.
//!   3. Everyone leaves (the attached drop their connections, A9; the detached are
//!      cancelled by `DELETE`): RSS after, against the fresh daemon's figure and
//!      against the figure once its ended-run retention was full (as many waiters as
//!      it retains came and went before the queue: what it keeps by design).
//!
//! Targets: detached <= 2 KiB each, attached <= 16 KiB each, idle CPU < 5% of a core,
//! release -> next grant p99 <= 5 ms with the queue full, RSS after leaving within 2x
//! of before.

use std::io::Write;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use crate::http::{field_u64, Conn};

const DETACHED_BYTES_TARGET: f64 = 2048.0;
const ATTACHED_BYTES_TARGET: f64 = 16384.0;
const IDLE_CPU_PCT_TARGET: f64 = 5.0;
const GRANT_P99_MS_TARGET: f64 = 5.0;
const RSS_AFTER_RATIO_TARGET: f64 = 2.0;
/// Connections the benchmark submits detached acquires (and cancels them) on.
const SUBMITTERS: usize = 16;
/// Releases timed with the queue full.
const GRANTS_TIMED: usize = 200;
const IDLE_WINDOW: Duration = Duration::from_secs(10);
/// After waiters leave, before RSS is read: past the daemon's `RELEASE_QUIET_MS`, when
/// it gives the freed memory back.
const SETTLE: Duration = Duration::from_secs(5);
/// Descriptors the benchmark asks for (both processes; root may raise the hard limit).
const NOFILE: u64 = 65_536;

/// The measured daemon: one slot, no auth, a queue deep enough; serves until killed.
pub fn daemon(state_dir: &Path) {
    let mut cfg = crate::http::config(state_dir, true);
    cfg.insecure_no_auth = true;
    cfg.engine.slots_max = 1;
    cfg.engine.queue_len_max = 1 << 20;
    crate::retention::serve(cfg);
}

fn raise_nofile() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let want = Rlimit {
        current: Some(NOFILE),
        maximum: Some(NOFILE),
    };
    if setrlimit(Resource::Nofile, want).is_err() {
        // Not root: as high as the hard limit lets an ordinary user go.
        let mut lim = getrlimit(Resource::Nofile);
        lim.current = lim.maximum;
        let _ = setrlimit(Resource::Nofile, lim);
    }
    getrlimit(Resource::Nofile).current.unwrap_or(NOFILE)
}

/// The daemon's process, killed however the benchmark ends (a panic included: it holds
/// the benchmark's stderr, and a reader of that would wait for it forever).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The daemon as /proc sees it: resident bytes, CPU ticks (user + system), descriptors.
struct Proc(u32);

impl Proc {
    fn rss_bytes(&self) -> f64 {
        crate::retention::rss_bytes(self.0)
    }

    fn cpu_ticks(&self) -> u64 {
        let path = format!("/proc/{}/stat", self.0);
        let (_, ticks) = crate::cpu::stat(std::path::Path::new(&path)).expect("the daemon's stat");
        ticks
    }

    fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.0))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// Percent of one core over `window`, nothing asked of the daemon meanwhile.
    fn idle_cpu_pct(&self, window: Duration) -> f64 {
        // /proc counts in USER_HZ, which Linux fixes at 100 on x86_64 and arm64.
        let hz = 100.0;
        let before = self.cpu_ticks();
        std::thread::sleep(window);
        (self.cpu_ticks() - before) as f64 / hz / window.as_secs_f64() * 100.0
    }
}

/// Projects the waiters belong to (an experiment's attempts share a few; `/v1/status`
/// lists every project, so 100,000 of them would make each poll of it 10 MB).
const PROJECTS: usize = 64;

fn acquire_body(id: &str, detach: bool) -> String {
    let n: usize = id[1..].parse().unwrap_or(0);
    format!(
        r#"{{"run_id":"{id}","project":"q-{}","wait_s":3000,"detach":{detach},"resources":{{"memory":1048576,"cpu_millis":1,"disk":0}}}}"#,
        n % PROJECTS
    )
}

fn queued(url: &str) -> u64 {
    let s: berth_client::wire::Status = ureq::get(format!("{url}/v1/status"))
        .call()
        .unwrap()
        .into_body()
        .read_json()
        .unwrap();
    s.queued.foreground
}

fn wait_queued(url: &str, n: u64) {
    let end = Instant::now() + Duration::from_secs(600);
    while queued(url) != n {
        assert!(Instant::now() < end, "{} queued, not {n}", queued(url));
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `method path` with `body` for every id, over `conns` connections; each answer must
/// have status `want`.
async fn for_each(
    url: &str,
    method: &str,
    conns: usize,
    ids: Vec<String>,
    body: fn(&str) -> String,
    want: u16,
) {
    let chunk = ids.len().div_ceil(conns).max(1);
    let mut tasks = Vec::new();
    for part in ids.chunks(chunk) {
        let (url, method, part) = (url.to_string(), method.to_string(), part.to_vec());
        tasks.push(tokio::spawn(async move {
            let mut c = Conn::open(&url).await;
            for id in part {
                let path = if method == "POST" {
                    "/v1/runs".to_string()
                } else {
                    format!("/v1/runs/{id}")
                };
                let (status, text) = c.request(&method, &path, "", &body(&id)).await.unwrap();
                assert_eq!(status, want, "{method} {id}: {text}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Releases the holder `GRANTS_TIMED` times; each time the queue's head (followed by
/// `GET ?wait_s=` on its own connection, asked before the release) is granted and holds
/// the slot next. Returns the latencies (ms) from sending the release to the head's
/// answer.
async fn time_grants(url: &str, mut holder: (String, u64), heads: &[String]) -> Vec<f64> {
    let mut c = Conn::open(url).await;
    let mut follow = Conn::open(url).await;
    let mut ms = Vec::new();
    for head in heads {
        let path = format!("/v1/runs/{head}?wait_s=30");
        let waiting = async { follow.request("GET", &path, "", "").await.unwrap() };
        let release = async {
            // The GET is sent first (it is polled first below); give it time to be read.
            tokio::time::sleep(Duration::from_millis(5)).await;
            let t = Instant::now();
            let path = format!("/v1/runs/{}/release", holder.0);
            let (st, text) = c
                .request("POST", &path, "", &format!(r#"{{"fence":{}}}"#, holder.1))
                .await
                .unwrap();
            assert_eq!(st, 200, "release {}: {text}", holder.0);
            t
        };
        let ((st, text), t) = tokio::join!(waiting, release);
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        assert!(
            st == 200 && text.contains("\"granted\""),
            "{head}: {st} {text}"
        );
        holder = (head.clone(), field_u64(&text, "\"fence\":").unwrap());
    }
    ms
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// Opens `n` long-poll acquires, each on its own socket, never read.
fn attach(url: &str, n: usize) -> Vec<std::net::TcpStream> {
    let host = url.trim_start_matches("http://");
    (0..n)
        .map(|i| {
            let body = acquire_body(&format!("a{i:06}"), false);
            let mut s = std::net::TcpStream::connect(host).unwrap();
            write!(
                s,
                "POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            s
        })
        .collect()
}

pub fn main(attached: usize, detached: usize) {
    let nofile = raise_nofile();
    assert!(
        nofile as usize > attached + 1024,
        "{attached} attached waiters need more descriptors than the limit of {nofile}"
    );
    assert!(
        detached > GRANTS_TIMED,
        "--detached must be above {GRANTS_TIMED}"
    );
    let dir = tempfile::tempdir().unwrap();
    let (child, url) = crate::retention::spawn_daemon("waiters-daemon", dir.path());
    let w = Stage {
        p: Proc(child.id()),
        url,
        rt: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap(),
    };
    let _child = Killed(child);
    let (st, text) = w.rt.block_on(async {
        let mut c = Conn::open(&w.url).await;
        let body = r#"{"run_id":"holder","project":"holder","wait_s":0,"resources":{"memory":1048576,"cpu_millis":1,"disk":0}}"#;
        c.request("POST", "/v1/runs", "", body).await.unwrap()
    });
    assert_eq!(st, 201, "{text}");
    let holder = (
        "holder".to_string(),
        field_u64(&text, "\"fence\":").unwrap(),
    );
    std::thread::sleep(Duration::from_secs(1));
    let rss_before = w.p.rss_bytes();
    let fds_before = w.p.fds();
    let rss_warm = w.warm(dir.path());
    let ids = w.detached(detached, holder, rss_warm);
    let conns = w.attached(attached, (detached - GRANTS_TIMED) as u64, fds_before);
    // 3. Everyone leaves.
    drop(conns);
    let rest: Vec<String> = ids[GRANTS_TIMED..].to_vec();
    let url = &w.url;
    w.rt.block_on(for_each(
        url,
        "DELETE",
        SUBMITTERS,
        rest,
        |_| String::new(),
        200,
    ));
    wait_queued(url, 0);
    std::thread::sleep(SETTLE);
    let rss_after = w.p.rss_bytes();
    let ratio = rss_after / rss_before;
    let ratio_warm = rss_after / rss_warm;
    println!(
        "{{\"bench\":\"waiters\",\"kind\":\"after_leaving\",\"rss_fresh_mib\":{:.1},\"rss_retention_full_mib\":{:.1},\"rss_after_mib\":{:.1},\"ratio_to_fresh\":{ratio:.2},\"ratio_to_retention_full\":{ratio_warm:.2},\"descriptors\":{},\"met\":{}}}",
        rss_before / 1048576.0,
        rss_warm / 1048576.0,
        rss_after / 1048576.0,
        w.p.fds(),
        ratio <= RSS_AFTER_RATIO_TARGET
    );
}

/// The daemon under test and the runtime that drives its clients.
struct Stage {
    p: Proc,
    url: String,
    rt: tokio::runtime::Runtime,
}

impl Stage {
    /// A daemon in service remembers its last `ended_retained_max` ended runs (for late
    /// clients' GETs): as many waiters as that come and go first, so that the figure
    /// after the queue leaves can be told apart from what retention keeps by design.
    /// Its RSS then.
    fn warm(&self, state: &std::path::Path) -> f64 {
        let retained = crate::http::config(state, true).engine.ended_retained_max;
        let warm: Vec<String> = (0..retained).map(|i| format!("w{i:06}")).collect();
        self.rt.block_on(async {
            let body = |id: &str| acquire_body(id, true);
            for_each(&self.url, "POST", SUBMITTERS, warm.clone(), body, 202).await;
            for_each(
                &self.url,
                "DELETE",
                SUBMITTERS,
                warm,
                |_| String::new(),
                200,
            )
            .await;
        });
        wait_queued(&self.url, 0);
        std::thread::sleep(SETTLE);
        self.p.rss_bytes()
    }

    /// Stage 1, detached waiters: what each costs, the idle CPU, and release-to-grant times
    /// for the first `GRANTS_TIMED`. Their ids.
    fn detached(&self, detached: usize, holder: (String, u64), rss_warm: f64) -> Vec<String> {
        let ids: Vec<String> = (0..detached).map(|i| format!("d{i:06}")).collect();
        let t = Instant::now();
        // The heads that `time_grants` follows are queued first, in order; the rest on
        // several connections at once (their order among themselves is whatever it is).
        self.rt.block_on(async {
            let (heads, rest) = ids.split_at(GRANTS_TIMED);
            let body = |id: &str| acquire_body(id, true);
            for_each(&self.url, "POST", 1, heads.to_vec(), body, 202).await;
            for_each(&self.url, "POST", SUBMITTERS, rest.to_vec(), body, 202).await;
        });
        let submit_s = t.elapsed().as_secs_f64();
        wait_queued(&self.url, detached as u64);
        std::thread::sleep(Duration::from_secs(2));
        let rss_detached = self.p.rss_bytes();
        let per_detached = (rss_detached - rss_warm) / detached as f64;
        let idle_detached = self.p.idle_cpu_pct(IDLE_WINDOW);
        let mut grant_ms = self
            .rt
            .block_on(time_grants(&self.url, holder, &ids[..GRANTS_TIMED]));
        let (p50, p99) = (pct(&mut grant_ms, 0.5), pct(&mut grant_ms, 0.99));
        println!(
            "{{\"bench\":\"waiters\",\"kind\":\"detached\",\"waiters\":{detached},\"submit_per_s\":{:.0},\"rss_before_mib\":{:.1},\"rss_mib\":{:.1},\"bytes_per_waiter\":{per_detached:.0},\"idle_cpu_pct\":{idle_detached:.2},\"release_to_grant_p50_ms\":{p50:.2},\"release_to_grant_p99_ms\":{p99:.2},\"met\":{}}}",
            detached as f64 / submit_s,
            rss_warm / 1048576.0,
            rss_detached / 1048576.0,
            per_detached <= DETACHED_BYTES_TARGET
                && idle_detached < IDLE_CPU_PCT_TARGET
                && p99 <= GRANT_P99_MS_TARGET
        );
        ids
    }

    /// Stage 2, attached waiters behind the `left` detached ones: what each costs, the idle
    /// CPU and the descriptors. Their connections (dropping them is leaving).
    fn attached(&self, attached: usize, left: u64, fds_before: usize) -> Vec<std::net::TcpStream> {
        let rss_base = self.p.rss_bytes();
        let conns = attach(&self.url, attached);
        wait_queued(&self.url, left + attached as u64);
        std::thread::sleep(Duration::from_secs(2));
        let rss_attached = self.p.rss_bytes();
        let per_attached = (rss_attached - rss_base) / attached.max(1) as f64;
        let idle_all = self.p.idle_cpu_pct(IDLE_WINDOW);
        let fds = self.p.fds();
        println!(
            "{{\"bench\":\"waiters\",\"kind\":\"attached\",\"waiters\":{attached},\"queued_in_all\":{},\"rss_mib\":{:.1},\"bytes_per_waiter\":{per_attached:.0},\"idle_cpu_pct\":{idle_all:.2},\"descriptors_before\":{fds_before},\"descriptors\":{fds},\"met\":{}}}",
            left + attached as u64,
            rss_attached / 1048576.0,
            per_attached <= ATTACHED_BYTES_TARGET && idle_all < IDLE_CPU_PCT_TARGET
        );
        conns
    }
}
