//! berth's benchmarks. Each prints JSON lines with its figures; none is a test.
//!
//! `berth-bench core`: the cost of one admission pass (the work after one release that
//! grants whatever now fits) at queue depths of 10 to 100,000 waiters, the engine's
//! memory per waiter, and the same pass done the naive way in the same run.

use std::alloc::{GlobalAlloc, Layout};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::time::Instant;

use berth_core::{Class, Command, Config, Engine, Event, Priority, Request, Resources, GIB};
use clap::{Parser, Subcommand};

/// Counts live heap bytes so `bytes_per_waiter` is measured, not estimated. Allocates
/// with the daemon's own allocator, so the embedded daemon runs as `berth serve` does.
struct Counting;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);
/// On for `core` only: in the HTTP benchmark the shared counter, bounced between the
/// cores by every allocation of every thread, would cost the daemon what `berth serve`
/// never pays.
static COUNTING: AtomicBool = AtomicBool::new(false);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        unsafe { mimalloc::MiMalloc.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if COUNTING.load(Ordering::Relaxed) {
            LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        }
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            LIVE_BYTES.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[derive(Parser)]
#[command(about = "berth benchmarks; each prints JSON lines")]
struct Args {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Subcommand)]
enum Bench {
    /// Admission pass cost and memory per waiter at 10 .. 100,000 waiters.
    Core {
        /// Passes measured per depth.
        #[arg(long, default_value_t = 2000)]
        passes: usize,
        /// Passes measured for the naive baseline per depth (it is slow at depth).
        #[arg(long, default_value_t = 200)]
        naive_passes: usize,
    },
    /// Issue 36: 32 runs on a 2 GiB claims budget, 4 ballooning past their claim:
    /// OOM kills outside runs (0), inside (the 4), well-behaved runs completed (28).
    Fanout,
    /// Restart with N expired runs (process trees, logs) and time the reaping.
    Recovery {
        #[arg(long, default_value_t = 1000)]
        runs: usize,
    },
    /// acquire -> release lifecycles over HTTP against a real daemon on SQLite.
    Http {
        #[arg(long, default_value_t = 64)]
        clients: usize,
        /// Clients that follow the event stream (`GET /v1/events`) meanwhile.
        #[arg(long, default_value_t = 0)]
        subscribers: usize,
        #[arg(long, default_value_t = 10)]
        seconds: u64,
    },
    /// Restart on a ledger holding N historic (ended) runs: time to serving and RSS
    /// against an empty daemon's, then again once retention has pruned them.
    Retention {
        #[arg(long, default_value_t = 1_000_000)]
        runs: u64,
    },
    /// (The floors of `peers`, in their own process: see floor.rs.)
    #[command(hide = true)]
    FloorDaemon {
        #[arg(long)]
        port: u16,
        /// Rename a ready-made directory in and out per lifecycle, made under here.
        #[arg(long)]
        workspaces: Option<std::path::PathBuf>,
    },
    /// (The daemon `retention` measures, in its own process.)
    #[command(hide = true)]
    RetentionDaemon { state_dir: std::path::PathBuf },
    /// A deep queue against a real daemon in its own process: RSS per detached and
    /// attached waiter, idle CPU, release -> next grant latency, descriptors, and RSS
    /// once everyone left.
    Waiters {
        #[arg(long, default_value_t = 10_000)]
        attached: usize,
        #[arg(long, default_value_t = 100_000)]
        detached: usize,
    },
    /// Fleet mode: N daemons on one PostgreSQL (PGHOST, PGPORT, PGUSER, PGPASSWORD),
    /// lifecycles per second fleet-wide with and without a budget token, beside the
    /// single-host SQLite figure and pgbench's insert-then-delete lifecycle.
    Fleet {
        #[arg(long, default_value_t = 3)]
        hosts: usize,
        #[arg(long, default_value_t = 64)]
        clients: usize,
        #[arg(long, default_value_t = 10)]
        seconds: u64,
    },
    /// (The daemon `waiters` measures, in its own process.)
    #[command(hide = true)]
    WaitersDaemon { state_dir: std::path::PathBuf },
    /// Reliability from real runs: daemon kill -9s (plain and at every failpoint) under
    /// load with acknowledged operations lost, fences repeated and capacity leaked;
    /// killed `berth run` clients; strangers signalled under forced pid reuse.
    /// scripts/reliability.sh runs it with a failpoints build, and the fuzz and
    /// linearizability tests in their long form.
    Reliability {
        /// The berth binary (a `--features failpoints` build crashes at each point).
        #[arg(long)]
        berth: std::path::PathBuf,
        /// Daemon crashes: every other one at a failpoint, in turn.
        #[arg(long, default_value_t = 20)]
        kills: usize,
        /// `berth run` clients killed.
        #[arg(long, default_value_t = 10)]
        client_kills: usize,
        /// Forced pid reuse trials (root only).
        #[arg(long, default_value_t = 20)]
        strangers: usize,
        /// KEY=VALUE for the fuzz and linearizability tests run first (repeatable),
        /// e.g. BERTH_FUZZ_CASES=20000.
        #[arg(long = "test-env", value_parser = parse_kv)]
        test_env: Vec<(String, String)>,
        /// Skip the fuzz and linearizability tests (their figures print as absent).
        #[arg(long)]
        no_tests: bool,
    },
    /// berth beside Redis (appendfsync always), PostgreSQL and etcd: the same durable
    /// fenced-lease lifecycle against each server in turn, each started here with a
    /// fresh data dir (scripts/peers.sh installs them). One JSON line per peer and
    /// client count, then berth's ratios to each.
    Peers {
        /// Client counts, each measured against every peer.
        #[arg(long, value_delimiter = ',', default_value = "1,64")]
        clients: Vec<usize>,
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Which servers: berth, berth-lease (no workspace), redis, postgres, etcd,
        /// and the floors floor-http and floor-http-ws (berth's HTTP stack doing
        /// nothing, without and with a workspace's two renames: bounds, not peers).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "berth,berth-lease,redis,postgres,etcd,floor-http,floor-http-ws"
        )]
        peers: Vec<String>,
    },
}

mod cpu;
mod fanout;
mod fleet;
mod floor;
mod http;
mod peers;
mod recovery;
mod reliability;
mod retention;
mod waiters;

const SLOTS: u64 = 8;
const PROJECTS: u64 = 512;

fn request(i: u64) -> Request {
    Request {
        run_id: format!("run-{i:08}"),
        project: format!("team/project-{}", i % PROJECTS),
        class: Class::Managed,
        priority: Priority::Foreground,
        resources: Resources {
            slots: 1,
            memory: GIB,
            cpu_millis: 500,
            disk: GIB,
            named: BTreeMap::new(),
        },
        singletons: vec![],
        contract: None,
        ttl_ms: 3_600_000,
        wait_ms: 3_600_000,
        budget: None,
    }
}

fn config() -> Config {
    let mut c = Config::for_host(64, 512 * GIB, 4096 * GIB);
    c.slots_max = SLOTS;
    c.queue_len_max = 200_000;
    c
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

/// Engine passes at one depth: returns (p50 µs, p99 µs, bytes per waiter).
fn engine_depth(depth: u64, passes: usize) -> (f64, f64, f64) {
    let mut engine = Engine::new(config(), 0).expect("config");
    let mut now = 1;
    let mut next = 0u64;
    let mut holders = std::collections::VecDeque::new();
    // Fill every slot, then measure the heap the waiters add.
    for _ in 0..SLOTS {
        let out = engine.apply(now, Command::Acquire(request(next)));
        next += 1;
        for ev in out.events {
            if let Event::Granted { run_id, fence, .. } = ev {
                holders.push_back((run_id, fence));
            }
        }
    }
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    for _ in 0..depth {
        engine.apply(now, Command::Acquire(request(next)));
        next += 1;
    }
    let after = LIVE_BYTES.load(Ordering::Relaxed);
    let bytes_per_waiter = (after - before) as f64 / depth as f64;
    assert_eq!(engine.queue_len() as u64, depth);

    let mut samples = Vec::with_capacity(passes);
    for _ in 0..passes {
        now += 1;
        let (run_id, fence) = holders.pop_front().expect("a holder");
        engine.apply(
            now,
            Command::Release {
                run_id: run_id.clone(),
                fence,
            },
        );
        let started = Instant::now();
        let out = engine.apply(now, Command::StopDone { run_id, ok: true });
        samples.push(started.elapsed().as_secs_f64() * 1e6);
        for ev in out.events {
            if let Event::Granted { run_id, fence, .. } = ev {
                holders.push_back((run_id, fence));
            }
        }
        // Keep the depth constant (not timed).
        engine.apply(now, Command::Acquire(request(next)));
        next += 1;
    }
    assert_eq!(engine.queue_len() as u64, depth);
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (
        percentile(&samples, 0.5),
        percentile(&samples, 0.99),
        bytes_per_waiter,
    )
}

/// What the systems berth learns from do on each pass: re-scan every waiter for a fit,
/// and check each current holder's liveness by searching the whole waiter list.
struct Naive {
    waiters: Vec<(String, u64, u64, String)>, // id, slots, memory, key
    holders: Vec<(String, u64, u64, String)>,
    slots_free: u64,
    memory_free: u64,
}

impl Naive {
    fn pass(&mut self) {
        // Liveness: a holder whose id also appears among the waiters is a stale duplicate.
        let mut i = 0;
        while i < self.holders.len() {
            let id = &self.holders[i].0;
            if self.waiters.iter().any(|w| &w.0 == id) {
                let h = self.holders.remove(i);
                self.slots_free += h.1;
                self.memory_free += h.2;
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.waiters.len() {
            let w = &self.waiters[i];
            let key_free = !self.holders.iter().any(|h| h.3 == w.3);
            if w.1 <= self.slots_free && w.2 <= self.memory_free && key_free {
                let w = self.waiters.remove(i);
                self.slots_free -= w.1;
                self.memory_free -= w.2;
                self.holders.push(w);
            } else {
                i += 1;
            }
        }
    }
}

fn naive_depth(depth: u64, passes: usize) -> f64 {
    let entry = |i: u64| {
        let r = request(i);
        (r.run_id, 1, GIB, format!("project:{}:runtime", r.project))
    };
    let mut n = Naive {
        waiters: (SLOTS..SLOTS + depth).map(entry).collect(),
        holders: (0..SLOTS).map(entry).collect(),
        slots_free: 0,
        memory_free: 500 * GIB,
    };
    let mut samples = Vec::with_capacity(passes);
    for next in (SLOTS + depth..).take(passes) {
        let h = n.holders.remove(0);
        n.slots_free += h.1;
        n.memory_free += h.2;
        let started = Instant::now();
        n.pass();
        samples.push(started.elapsed().as_secs_f64() * 1e6);
        n.waiters.push(entry(next));
    }
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    percentile(&samples, 0.99)
}

/// As `berth serve` gives memory back (see crates/berth/src/main.rs).
fn release_memory() {
    // SAFETY: `mi_collect` takes no pointers and may be called from any thread.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?}: expected KEY=VALUE"))
}

fn main() {
    // The daemons' logs, when asked for (`BERTH_LOG=info`), on stderr beside the figures.
    if let Ok(filter) = std::env::var("BERTH_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    berth_server::memory::set_release(release_memory);
    let args = Args::parse();
    match args.bench {
        Bench::Http {
            clients,
            subscribers,
            seconds,
        } => http::main(clients, subscribers, seconds),
        Bench::Recovery { runs } => recovery::main(runs),
        Bench::Fanout => fanout::main(),
        Bench::Fleet {
            hosts,
            clients,
            seconds,
        } => fleet::main(hosts, clients, seconds),
        Bench::Retention { runs } => retention::main(runs),
        Bench::Reliability {
            berth,
            kills,
            client_kills,
            strangers,
            test_env,
            no_tests,
        } => {
            let tests = (!no_tests).then_some(test_env.as_slice());
            reliability::main(&berth, kills, client_kills, strangers, tests)
        }
        Bench::Peers {
            clients,
            seconds,
            peers,
        } => peers::main(&peers, &clients, seconds),
        Bench::FloorDaemon { port, workspaces } => floor::daemon(port, workspaces.as_deref()),
        Bench::RetentionDaemon { state_dir } => retention::daemon(&state_dir),
        Bench::Waiters { attached, detached } => waiters::main(attached, detached),
        Bench::WaitersDaemon { state_dir } => waiters::daemon(&state_dir),
        Bench::Core {
            passes,
            naive_passes,
        } => {
            COUNTING.store(true, Ordering::Relaxed);
            for depth in [10u64, 1_000, 10_000, 100_000] {
                let (p50, p99, bytes) = engine_depth(depth, passes);
                let naive_p99 = naive_depth(depth, naive_passes);
                println!(
                    "{{\"waiters\":{depth},\"pass_p50_us\":{p50:.2},\"pass_p99_us\":{p99:.2},\"bytes_per_waiter\":{bytes:.0},\"naive_pass_p99_us\":{naive_p99:.2},\"speedup_p99\":{:.1}}}",
                    naive_p99 / p99
                );
            }
        }
    }
}
