//! `GET /metrics`: what berth does, in Prometheus' text format.
//!
//! Counters move where things happen (the daemon counts each journal entry as it makes
//! it, the ledger thread times each commit, the HTTP layer counts each answer); gauges
//! of the queue and of capacity are read from the engine's snapshot at each scrape, so
//! they are never stale and cost nothing between scrapes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    // Static: a journal entry's kind is one of berth's words, and a lookup builds no
    // String (this runs for every entry).
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabel {
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PriorityLabel {
    priority: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabel {
    resource: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HarnessLabels {
    scope: String,
    harness: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RunLabel {
    run_id: String,
}

/// Issue 36: per-run gauges are kept for at most this many runs (those using the
/// most memory), so a host with thousands of runs does not make thousands of series.
pub const RUN_GAUGES_MAX: usize = 64;

/// Per-run use gauges (issue 36), set at each scrape.
#[derive(Default)]
struct RunGauges {
    memory: Family<RunLabel, Gauge>,
    memory_claim: Family<RunLabel, Gauge>,
    memory_peak: Family<RunLabel, Gauge>,
    processes: Family<RunLabel, Gauge>,
    cpu: Family<RunLabel, Gauge<f64, AtomicU64>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    // Static: a route of the route table (or "unmatched") and a method's name, so that
    // counting a request builds no String (this runs for every request).
    route: &'static str,
    method: &'static str,
    status: u16,
}

/// Every metric berth exports, registered once at start.
pub struct Metrics {
    registry: Registry,
    journal: Family<KindLabel, Counter>,
    grants: Counter,
    releases: Counter,
    expiries: Counter,
    reaps: Counter,
    degraded: Counter,
    oom_kills: Counter,
    runs: RunGauges,
    refusals: Family<CodeLabel, Counter>,
    queue_depth: Family<PriorityLabel, Gauge>,
    queue_reasons: Family<ReasonLabel, Gauge>,
    capacity_total: Family<ResourceLabel, Gauge>,
    capacity_committed: Family<ResourceLabel, Gauge>,
    capacity_available: Family<ResourceLabel, Gauge>,
    budget_held: Family<HarnessLabels, Gauge>,
    budget_limit: Family<HarnessLabels, Gauge>,
    budget_lapsed: Family<HarnessLabels, Gauge>,
    commit_seconds: Histogram,
    commit_batches: Histogram,
    fleet_batches: Histogram,
    http: Family<HttpLabels, Counter>,
    subscribers: Gauge,
    subscribers_now: AtomicU64,
    waiter_polls: Counter,
    state_messages: Counter,
    /// One scrape at a time sets the gauges it renders.
    rendering: std::sync::Mutex<()>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        let mut m = Metrics {
            registry: Registry::with_prefix("berth"),
            journal: Family::default(),
            grants: Counter::default(),
            releases: Counter::default(),
            expiries: Counter::default(),
            reaps: Counter::default(),
            degraded: Counter::default(),
            oom_kills: Counter::default(),
            runs: RunGauges::default(),
            refusals: Family::default(),
            queue_depth: Family::default(),
            queue_reasons: Family::default(),
            capacity_total: Family::default(),
            capacity_committed: Family::default(),
            capacity_available: Family::default(),
            budget_held: Family::default(),
            budget_limit: Family::default(),
            budget_lapsed: Family::default(),
            // 50 µs to ~1.6 s: an fsync here is ~0.2 ms, a stalled disk seconds.
            commit_seconds: Histogram::new(exponential_buckets(0.000_05, 2.0, 16)),
            // 1 to 4096 batches (GROUP_MAX).
            commit_batches: Histogram::new(exponential_buckets(1.0, 2.0, 13)),
            fleet_batches: Histogram::new(exponential_buckets(1.0, 2.0, 9)),
            http: Family::default(),
            subscribers: Gauge::default(),
            subscribers_now: AtomicU64::new(0),
            waiter_polls: Counter::default(),
            state_messages: Counter::default(),
            rendering: std::sync::Mutex::new(()),
        };
        m.register();
        m.register_waiting();
        m.register_budgets();
        m.register_runs();
        m
    }
}

impl Metrics {
    /// What waiting costs the daemon (issue 18: no work per waiter while nothing changes).
    fn register_waiting(&mut self) {
        self.registry.register(
            "waiter_polls",
            "Times a waiting stream re-read its run because the queue moved (at most once a second each, for its position and reason); with nothing moving, no waiter costs any",
            self.waiter_polls.clone(),
        );
        self.registry.register(
            "state_messages",
            "Messages the daemon's state task handled (requests and process reports, not its timer): with nothing changing, it does not grow with the number of waiters",
            self.state_messages.clone(),
        );
    }

    /// Issue 36: runs' use of their claims.
    fn register_runs(&mut self) {
        let (r, g) = (&mut self.registry, &self.runs);
        r.register(
            "runs_oom_killed",
            "Runs in which the kernel's OOM killer killed (inside the run's cgroup, past its hard memory limit)",
            self.oom_kills.clone(),
        );
        r.register(
            "run_memory_bytes",
            "Memory a granted run's cgroup uses now (the RUN_GAUGES_MAX runs using most)",
            g.memory.clone(),
        );
        r.register(
            "run_memory_claim_bytes",
            "The memory a granted run claimed (same runs as run_memory_bytes)",
            g.memory_claim.clone(),
        );
        r.register(
            "run_memory_peak_bytes",
            "The most memory a granted run's cgroup has used (same runs)",
            g.memory_peak.clone(),
        );
        r.register(
            "run_processes",
            "Processes and threads in a granted run's cgroup now (same runs)",
            g.processes.clone(),
        );
        r.register(
            "run_cpu_seconds",
            "CPU time a granted run's cgroup has used (same runs)",
            g.cpu.clone(),
        );
    }

    fn register_budgets(&mut self) {
        let r = &mut self.registry;
        r.register(
            "budget_tokens_held",
            "Budget tokens held, by experiment scope and harness (B6)",
            self.budget_held.clone(),
        );
        r.register(
            "budget_tokens_limit",
            "Each harness's frozen limit, by experiment scope (B1)",
            self.budget_limit.clone(),
        );
        r.register(
            "budget_tokens_owner_lapsed",
            "Budget tokens held for an owner whose lease lapsed (B3), by scope and harness",
            self.budget_lapsed.clone(),
        );
    }

    fn register(&mut self) {
        let r = &mut self.registry;
        r.register(
            "journal_entries",
            "Journal entries written, by kind",
            self.journal.clone(),
        );
        r.register("grants", "Runs granted", self.grants.clone());
        r.register(
            "releases",
            "Runs released by their owner",
            self.releases.clone(),
        );
        r.register(
            "expiries",
            "Leases that expired (L6)",
            self.expiries.clone(),
        );
        r.register(
            "reaps",
            "Runs the reaper stopped or cleaned again (P4)",
            self.reaps.clone(),
        );
        r.register(
            "degraded",
            "Times a run degraded: its stop or cleanup failed (L3)",
            self.degraded.clone(),
        );
        r.register(
            "refusals",
            "Acquires refused, by error code",
            self.refusals.clone(),
        );
        r.register(
            "queue_depth",
            "Runs waiting, by priority",
            self.queue_depth.clone(),
        );
        r.register(
            "queue_waiters_by_reason",
            "Runs waiting, by the code of the reason they wait (A11)",
            self.queue_reasons.clone(),
        );
        self.register_capacity_and_io();
    }

    /// Capacity, the ledger's commits, HTTP and the event streams.
    fn register_capacity_and_io(&mut self) {
        let r = &mut self.registry;
        r.register(
            "capacity_total",
            "Each resource's total (bytes, CPU millis or a count)",
            self.capacity_total.clone(),
        );
        r.register(
            "capacity_committed",
            "Each resource's amount held by live runs",
            self.capacity_committed.clone(),
        );
        r.register(
            "capacity_available",
            "Each resource's amount admission may still grant",
            self.capacity_available.clone(),
        );
        r.register(
            "ledger_commit_seconds",
            "Time of each ledger transaction, fsync included",
            self.commit_seconds.clone(),
        );
        r.register(
            "ledger_commit_batches",
            "Batches (requests' changes) each ledger transaction carried (group commit)",
            self.commit_batches.clone(),
        );
        r.register(
            "fleet_batch_ops",
            "Claims, re-fences and endings each round trip to the fleet store carried (fleet mode)",
            self.fleet_batches.clone(),
        );
        r.register(
            "http_requests",
            "HTTP requests answered, by route, method and status",
            self.http.clone(),
        );
        r.register(
            "sse_subscribers",
            "Event streams (GET /v1/events) open now",
            self.subscribers.clone(),
        );
    }

    /// One journal entry made, by kind (and the counters some kinds stand for).
    pub fn journaled(&self, kind: &'static str) {
        self.journal.get_or_create(&KindLabel { kind }).inc();
        match kind {
            "granted" => self.grants.inc(),
            "released" => self.releases.inc(),
            "expired" => self.expiries.inc(),
            "reaped" => self.reaps.inc(),
            "degraded" => self.degraded.inc(),
            "oom_killed" => self.oom_kills.inc(),
            _ => 0,
        };
    }

    /// The state task handled a message.
    pub fn state_message(&self) {
        self.state_messages.inc();
    }

    /// A waiting stream re-read its run because the queue moved.
    pub fn waiter_polled(&self) {
        self.waiter_polls.inc();
    }

    /// An acquire refused (journaled as `refused`), by its error code.
    pub fn refused(&self, code: &str) {
        self.refusals
            .get_or_create(&CodeLabel { code: code.into() })
            .inc();
    }

    /// A ledger transaction committed (called on the ledger thread).
    pub fn committed(&self, took: Duration, batches: usize) {
        self.commit_seconds.observe(took.as_secs_f64());
        self.commit_batches.observe(batches as f64);
    }

    /// A batch of `ops` carried out by the fleet store (called on a fleet thread).
    pub fn fleet_batched(&self, ops: usize) {
        self.fleet_batches.observe(ops as f64);
    }

    pub fn http(&self, route: &'static str, method: &axum::http::Method, status: u16) {
        use axum::http::Method;
        let method = match *method {
            Method::GET => "GET",
            Method::POST => "POST",
            Method::DELETE => "DELETE",
            Method::PUT => "PUT",
            Method::PATCH => "PATCH",
            Method::HEAD => "HEAD",
            Method::OPTIONS => "OPTIONS",
            _ => "other",
        };
        self.http
            .get_or_create(&HttpLabels {
                route,
                method,
                status,
            })
            .inc();
    }

    /// An event stream opened (+1) or closed (-1).
    pub fn subscriber(&self, opened: bool) {
        let n = if opened {
            self.subscribers_now.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            self.subscribers_now.fetch_sub(1, Ordering::Relaxed) - 1
        };
        self.subscribers.set(n as i64);
    }

    /// The registry in text format, with the gauges set from this scrape's figures.
    pub fn render(&self, now: &Scrape) -> String {
        let _one = self.rendering.lock().unwrap_or_else(|p| p.into_inner());
        self.queue_depth.clear();
        for (priority, n) in [
            ("foreground", now.foreground),
            ("background", now.background),
        ] {
            self.queue_depth
                .get_or_create(&PriorityLabel {
                    priority: priority.into(),
                })
                .set(n as i64);
        }
        self.queue_reasons.clear();
        for (reason, n) in &now.reasons {
            self.queue_reasons
                .get_or_create(&ReasonLabel {
                    reason: reason.clone(),
                })
                .set(*n as i64);
        }
        for f in [
            &self.capacity_total,
            &self.capacity_committed,
            &self.capacity_available,
        ] {
            f.clear();
        }
        for r in &now.resources {
            let l = ResourceLabel {
                resource: r.name.clone(),
            };
            let clamp = |v: u64| v.min(i64::MAX as u64) as i64;
            self.capacity_total.get_or_create(&l).set(clamp(r.total));
            self.capacity_committed
                .get_or_create(&l)
                .set(clamp(r.committed));
            self.capacity_available
                .get_or_create(&l)
                .set(clamp(r.available));
        }
        for f in [&self.budget_held, &self.budget_limit, &self.budget_lapsed] {
            f.clear();
        }
        for s in &now.scopes {
            for (harness, fig) in &s.harnesses {
                let l = HarnessLabels {
                    scope: s.scope.clone(),
                    harness: harness.clone(),
                };
                self.budget_held.get_or_create(&l).set(fig.held.into());
                self.budget_limit.get_or_create(&l).set(fig.limit.into());
                self.budget_lapsed.get_or_create(&l).set(fig.lapsed.into());
            }
        }
        self.render_runs(&now.runs);
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

impl Metrics {
    /// Sets the per-run gauges: the `RUN_GAUGES_MAX` runs using the most memory.
    fn render_runs(&self, runs: &[RunUse]) {
        let g = &self.runs;
        g.memory.clear();
        g.memory_claim.clear();
        g.memory_peak.clear();
        g.processes.clear();
        g.cpu.clear();
        let mut top: Vec<&RunUse> = runs.iter().collect();
        top.sort_by_key(|r| std::cmp::Reverse(r.usage.memory_bytes.unwrap_or(0)));
        let clamp = |v: u64| v.min(i64::MAX as u64) as i64;
        for r in top.into_iter().take(RUN_GAUGES_MAX) {
            let l = RunLabel {
                run_id: r.run_id.clone(),
            };
            let u = &r.usage;
            g.memory_claim.get_or_create(&l).set(clamp(r.memory_claim));
            if let Some(v) = u.memory_bytes {
                g.memory.get_or_create(&l).set(clamp(v));
            }
            if let Some(v) = u.memory_peak_bytes {
                g.memory_peak.get_or_create(&l).set(clamp(v));
            }
            if let Some(v) = u.pids {
                g.processes.get_or_create(&l).set(clamp(v));
            }
            if let Some(v) = u.cpu_usec {
                g.cpu.get_or_create(&l).set(v as f64 / 1e6);
            }
        }
    }
}

/// One granted run's use, for the per-run gauges.
#[derive(Debug)]
pub struct RunUse {
    pub run_id: String,
    pub memory_claim: u64,
    pub usage: berth_proc::limits::Usage,
}

/// A scrape's figures from the engine.
#[derive(Debug, Default)]
pub struct Scrape {
    /// Granted runs' use of their claims (issue 36).
    pub runs: Vec<RunUse>,
    pub foreground: u64,
    pub background: u64,
    /// Waiters by reason code.
    pub reasons: std::collections::BTreeMap<String, u64>,
    pub resources: Vec<berth_client::wire::ResourceStatus>,
    /// Budget tokens per scope and harness.
    pub scopes: Vec<berth_client::wire::ScopeSummary>,
}
