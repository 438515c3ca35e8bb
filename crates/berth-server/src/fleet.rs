//! Fleet mode's I/O (F1–F4): one thread owns the fleet store and carries out what the
//! daemon asks (claims, endings), heartbeats, and declares lapsed hosts dead; a second
//! answers the API's questions ([`Handle::ask`]) on a connection of its own, so they
//! never delay a claim or a heartbeat; a third LISTENs for wake-ups. None ever blocks
//! the daemon: results come back as messages to its inbox.
//!
//! **Architecture invariant:** the fleet thread never changes the daemon's state; it
//! reports ([`Report`], through a [`Tell`]) and the daemon decides.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use berth_store::fleet::FleetOp as Job;
pub use berth_store::fleet::HostInfo;
use berth_store::fleet::{
    ClaimOutcome, Ending, FleetError, FleetStore, HostRow, OpOutcome, Shared, BATCH_OPS_MAX,
    SHARED_PAYLOAD,
};
use tokio::sync::oneshot;

use crate::tell::Tell;

/// Endings not yet recorded (the store was away) kept for a retry at most; past it the
/// oldest are dropped with a warning and the next registration's reconciliation (the
/// dead-host rules) is what frees them.
pub const ENDS_PENDING_MAX: usize = 65_536;
/// Batches of missed endings retried per heartbeat at most (`BATCH_OPS_MAX` endings
/// each): the heartbeat's thread must not fall behind its beats.
pub const ENDS_RETRY_BATCHES_PER_BEAT: usize = 4;
/// Evidence invalidations not yet taken by the store (it was away) kept for a retry at
/// most; past it the oldest is dropped with a warning (the other hosts keep riding on
/// it until a run there refutes it too).
pub const INVALIDATIONS_PENDING_MAX: usize = 1_024;
/// Missed invalidations retried per heartbeat at most: a round trip each, on the
/// heartbeat's thread, whose beats must not fall behind (three late ones make the host
/// stale) when the store comes back to a long queue.
pub const INVALIDATIONS_PER_BEAT_MAX: usize = 16;
/// How often the listener gives up waiting and looks again (its reconnect pace, too).
const LISTEN_WAIT_MS: u64 = 1_000;

/// How fleet mode is set up (`berth serve --store …`).
#[derive(Clone, Debug)]
pub struct FleetConfig {
    /// `postgres://…` (or a libpq key=value string), or `sqlite:PATH` for a fleet of
    /// daemons on one machine sharing a file.
    pub url: String,
    pub host: HostInfo,
    /// Heartbeat period.
    pub beat_ms: u64,
    /// A host whose last heartbeat is older than this is declared dead (F2): the
    /// longest lease ttl plus a margin, so no lease it granted can still be renewed.
    pub lapse_ms: u64,
    /// Fallback re-check of waiters whose wake-up may have been lost (F3).
    pub recheck_ms: u64,
    /// The host's last fence as its ledger has it, set by `start`: the fleet's sequence
    /// is raised above it before the host registers (issue 38 item 1).
    pub fence_floor: u64,
}

/// Fleet mode's longest lease when `--ttl-max` is not given (issue 38 item 7). A host
/// that stops answering keeps its fleet keys until the lapse, `--ttl-max` plus
/// `--fleet-margin`: with the single-host default of 24 h that was a day. Ten minutes
/// is twice `berth run`'s default lease (5 min, renewed every third of it), so the
/// default client never notices, and a dead or hung host frees its keys after 10.5 min.
pub const FLEET_TTL_MS_MAX_DEFAULT: u64 = 600_000;

/// How long a question to the fleet store (`GET /v1/fleet`, a fence check, a
/// reconcile) and a new run's claim wait for the store at most before the
/// caller gets `503 store_unavailable` (issue 38 item 4). The store's own calls have no
/// deadline of their own yet: this bounds what a caller waits, not what a thread waits.
pub const ANSWER_WAIT_MS: u64 = 5_000;

/// The least slack between a host's self-fence stop (its grace included) and the lapse.
const FENCE_SLACK_MS_MIN: u64 = 1_000;

/// Heartbeats a starting host watches the row of its id for another instance's beat.
const ID_CHECK_BEATS: u64 = 3;

/// Issue 38 item 8: the row of this host's id seen twice, `waited_ms` apart, shows
/// another live instance beating under it: its generation moved, or its heartbeat came
/// again meanwhile (by more than half a beat of timing slack). A silent row is a dead
/// host's, or this host's own before a kill -9: taken over.
pub fn beating_meanwhile(first: &HostRow, second: &HostRow, waited_ms: i64, beat_ms: i64) -> bool {
    second.alive
        && (second.gen != first.gen
            || second.beat_age_ms < first.beat_age_ms + waited_ms - beat_ms / 2)
}

/// Issue 38 item 8: a host refuses to start while another live instance holds its id
/// (two daemons with one id each declared the other dead and re-registered, over and
/// over, and their runs' acquires expired). A row alive with a heartbeat younger than
/// the lapse is watched for `ID_CHECK_BEATS` heartbeats; `sleep` waits (a test's
/// does not).
fn check_id_free(
    store: &mut dyn FleetStore,
    cfg: &FleetConfig,
    sleep: impl Fn(Duration),
) -> Result<(), FleetError> {
    let id = cfg.host.host_id.as_str();
    let mut row = || -> Result<Option<HostRow>, FleetError> {
        Ok(store.hosts()?.into_iter().find(|h| h.host_id == id))
    };
    let lapse_ms = i64::try_from(cfg.lapse_ms).unwrap_or(i64::MAX);
    let first = match row()? {
        Some(h) if h.alive && h.beat_age_ms < lapse_ms => h,
        _ => return Ok(()),
    };
    let waited_ms = ID_CHECK_BEATS * cfg.beat_ms;
    sleep(Duration::from_millis(waited_ms));
    let Some(second) = row()? else { return Ok(()) };
    let beat_ms = i64::try_from(cfg.beat_ms).unwrap_or(i64::MAX);
    if beating_meanwhile(&first, &second, waited_ms as i64, beat_ms) {
        return Err(FleetError::HostIdInUse(format!(
            "host id {id} is held by another live berth at {} (generation {}, its last heartbeat {} ms ago): refusing to start; give this host another --host-id",
            second.address, second.gen, second.beat_age_ms
        )));
    }
    Ok(())
}

/// F2: how long after its last accepted heartbeat a host stops its runs that hold
/// fleet-wide claims, so that they are gone before the lapse at which another host may
/// take those claims. The stop itself takes up to `stop_grace_ms` (TERM, the grace,
/// KILL), so it starts at least the grace plus a slack before the lapse, and at least a
/// quarter of the lapse before it (issue 38 item 7: a quarter alone, 7.5 s of a 30 s
/// lapse, was shorter than the 10 s grace, and a child that ignored SIGTERM ran 2.5 s
/// beside the next holder). The slack, two heartbeats and at least `FENCE_SLACK_MS_MIN`,
/// covers what the host's own count adds: it starts when the heartbeat's answer
/// arrived, after the store wrote it, and is looked at every tick. A configuration that
/// leaves less than three heartbeats before the fence (one slow heartbeat would stop
/// every fleet run) is refused, naming the flags.
pub fn self_fence_ms(lapse_ms: u64, beat_ms: u64, stop_grace_ms: u64) -> Result<u64, String> {
    let slack = (2 * beat_ms).max(FENCE_SLACK_MS_MIN);
    let early = (lapse_ms / 4)
        .max(2 * beat_ms)
        .max(stop_grace_ms.saturating_add(slack));
    match lapse_ms.checked_sub(early) {
        Some(fence_ms) if fence_ms >= 3 * beat_ms => Ok(fence_ms),
        _ => Err(format!(
            "fleet mode: a host silent for --ttl-max + --fleet-margin ({lapse_ms} ms) is declared dead, and it must stop its fleet-wide runs before then: --stop-grace ({stop_grace_ms} ms) plus {slack} ms (two heartbeats, at least {FENCE_SLACK_MS_MIN} ms) before that, after at least three heartbeats of silence ({} ms); raise --ttl-max or --fleet-margin, or lower --stop-grace or --fleet-beat",
            3 * beat_ms
        )),
    }
}

/// What the daemon and the API read of the fleet without asking the thread.
#[derive(Debug, Default)]
pub struct Status {
    pub enabled: AtomicBool,
    /// The last store operation succeeded.
    pub available: AtomicBool,
    /// This host's generation (0 until registered).
    pub gen: AtomicI64,
    /// CLOCK_MONOTONIC ms of the last heartbeat the store accepted.
    pub beat_ok_ms: AtomicU64,
    pub host_id: Mutex<String>,
    /// The load the next heartbeat writes (the daemon refreshes it).
    pub load: Mutex<String>,
}

impl Status {
    pub fn available(&self) -> bool {
        self.available.load(Ordering::Relaxed)
    }
    pub fn gen(&self) -> i64 {
        self.gen.load(Ordering::Relaxed)
    }
    pub fn host_id(&self) -> String {
        self.host_id
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

type Question = Box<dyn FnOnce(&mut dyn FleetStore) + Send>;

/// Told the size of each batch the store carried out (`/metrics`).
pub type BatchObserver = Arc<dyn Fn(usize) + Send + Sync>;

/// API questions in flight at most. They have a thread and a connection of their own,
/// so that no number of them (a token holder checking fences in a loop) delays a claim
/// or a heartbeat, and past this many the next is refused (`503`) instead of queued.
pub const QUESTIONS_MAX: usize = 256;

#[derive(Clone)]
pub struct Handle {
    tx: std::sync::mpsc::Sender<Job>,
    questions: std::sync::mpsc::SyncSender<Question>,
    /// Wakes the heartbeat thread to read the fleet's tokens and drain now.
    nudge: std::sync::mpsc::Sender<()>,
    pub status: Arc<Status>,
    /// See [`Common::invalidations`].
    invalidations: Missed,
}

/// Invalidations the store missed, oldest first.
type Missed = Arc<Mutex<std::collections::VecDeque<SharedJob>>>;

impl Handle {
    pub fn send(&self, job: Job) {
        let _ = self.tx.send(job);
    }

    /// Has the fleet's tokens and drain read again now rather than at the next beat.
    pub fn nudge(&self) {
        let _ = self.nudge.send(());
    }

    /// Ask the store something from async code (the answer comes from the fleet
    /// thread; the caller's task waits, its worker does not).
    pub async fn ask<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn FleetStore) -> Result<T, FleetError> + Send + 'static,
    ) -> Result<T, FleetError> {
        let (tx, rx) = oneshot::channel();
        let q: Question = Box::new(move |s: &mut dyn FleetStore| {
            let _ = tx.send(f(s));
        });
        self.questions.try_send(q).map_err(|e| match e {
            std::sync::mpsc::TrySendError::Full(_) => FleetError::Unavailable(format!(
                "{QUESTIONS_MAX} fleet questions are in flight already"
            )),
            std::sync::mpsc::TrySendError::Disconnected(_) => {
                FleetError::Unavailable("the fleet thread has stopped".into())
            }
        })?;
        // Issue 38 item 4: a frozen link (its peer still acknowledging TCP) left the
        // question, and `GET /v1/fleet` with it, waiting for as long as it lasted.
        match tokio::time::timeout(Duration::from_millis(ANSWER_WAIT_MS), rx).await {
            Ok(answer) => answer
                .map_err(|_| FleetError::Unavailable("the fleet thread has stopped".into()))?,
            Err(_) => Err(FleetError::Unavailable(format!(
                "the fleet store did not answer within {ANSWER_WAIT_MS} ms"
            ))),
        }
    }
}

/// What the daemon tells the fleet store without waiting for an answer, once its own
/// commit is durable (issue 38 Build 3): promotion evidence proven here, or found wrong
/// here. Carried out on the question thread. An invalidation the store misses (it was
/// away) is retried at each heartbeat until it is taken: lost, it left the other hosts
/// promoting a project a run here showed is not parallel-safe. Evidence the store misses
/// is logged and dropped: retried late, it could bring back evidence another host
/// refuted meanwhile, and missing it costs only a promotion elsewhere.
#[derive(Clone, Debug)]
pub enum SharedJob {
    PutEvidence(berth_store::fleet::FleetEvidence),
    InvalidateEvidence {
        project: String,
        fingerprint: String,
        commit: Option<String>,
    },
}

impl Handle {
    /// Sends `job` to the store, after the commit that decided it.
    pub fn share(&self, job: SharedJob) {
        let missed = self.invalidations.clone();
        // Asked while the questions are full, an invalidation is missed as if the
        // store were away.
        let kept = matches!(job, SharedJob::InvalidateEvidence { .. }).then(|| job.clone());
        let q: Question = Box::new(move |s: &mut dyn FleetStore| {
            if let Err(e) = job.carry_out(s) {
                tracing::warn!(?job, "fleet: the store did not take it: {e}");
                if matches!(e, FleetError::Unavailable(_)) {
                    keep_missed(&missed, job);
                }
            }
        });
        if self.questions.try_send(q).is_err() {
            tracing::warn!("fleet: {QUESTIONS_MAX} fleet questions are in flight; promotion evidence not shared now");
            if let Some(job) = kept {
                keep_missed(&self.invalidations, job);
            }
        }
    }
}

impl SharedJob {
    fn carry_out(&self, s: &mut dyn FleetStore) -> Result<i64, FleetError> {
        match self {
            SharedJob::PutEvidence(e) => s.put_evidence(e),
            SharedJob::InvalidateEvidence {
                project,
                fingerprint,
                commit,
            } => s.invalidate_evidence(project, fingerprint, commit.as_deref()),
        }
    }
}

/// An invalidation the store missed (it was away) is kept for the heartbeat's retry
/// (see [`SharedJob`]); missed evidence is dropped.
fn keep_missed(missed: &Missed, job: SharedJob) {
    if !matches!(job, SharedJob::InvalidateEvidence { .. }) {
        return;
    }
    let mut missed = missed.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(dropped) = push_bounded(&mut missed, INVALIDATIONS_PENDING_MAX, job) {
        tracing::warn!(?dropped, "fleet: {INVALIDATIONS_PENDING_MAX} evidence invalidations wait for the store; the oldest is dropped");
    }
}

/// Keeps `item` in a queue of at most `max`: the oldest goes (returned) to make room.
fn push_bounded<T>(q: &mut std::collections::VecDeque<T>, max: usize, item: T) -> Option<T> {
    let dropped = (q.len() >= max).then(|| q.pop_front()).flatten();
    q.push_back(item);
    dropped
}

/// Opens the store a `--store` URL names. PostgreSQL is connected lazily (by the fleet
/// thread, at its first heartbeat): a host starts, and serves its own runs, while the
/// database is away.
pub fn open(url: &str) -> Result<Box<dyn FleetStore>, FleetError> {
    if let Some(path) = url.strip_prefix("sqlite:") {
        return Ok(Box::new(berth_store::fleet::SqliteFleet::open(path)?));
    }
    Ok(Box::new(berth_store::fleet::PgFleet::lazy(url)?))
}

/// Monotonic milliseconds, as the fleet threads read them (the simulator's own time in
/// `daemon::sim`).
type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// Issue 38 item 8 at start: refused if another live instance holds the id. On a
/// thread of its own, with a connection of its own dropped there: the store's client
/// blocks, and may be neither used nor dropped on the runtime this runs on (nor handed
/// on connected: the questions' connection opens when it is first asked).
fn check_id_at_start(cfg: &FleetConfig) -> Result<(), FleetError> {
    let (mut store, check_cfg) = (open(&cfg.url)?, cfg.clone());
    let checked =
        std::thread::spawn(move || check_id_free(&mut *store, &check_cfg, std::thread::sleep))
            .join()
            .unwrap_or_else(|_| Err(FleetError::Unavailable("the id check panicked".into())));
    match checked {
        Err(FleetError::HostIdInUse(e)) => Err(FleetError::HostIdInUse(e)),
        // Unknown while the store does not answer: the host serves unregistered until
        // it registers; if another instance holds the id by then, one of the two
        // loses its generation and stays out (`Worker::lost_generation`).
        Err(e) => {
            tracing::warn!(
                "fleet: could not check that host id {} is free: {e}",
                cfg.host.host_id
            );
            Ok(())
        }
        Ok(()) => Ok(()),
    }
}

/// Threads (each with its connection) that carry out claims and endings. The one sends
/// what has gathered since it last looked as one batch, one round trip and one
/// transaction (issue 38 Build 1), so the claims that arrive while a round trip is in
/// flight share the next one. One, not more: its answers then come back in the order
/// of their fences, and a permit below one this host already granted would be stale
/// (L1), a re-fence's round trip more, and a `wait_s = 0` run's one try lost (two
/// workers lost some, found by the lost-answer test). Two made no difference to
/// `berth-bench fleet` (4,355 and 4,345 lifecycles/s).
pub const CLAIM_WORKERS: usize = 1;

/// Starts the fleet threads: the heartbeat, the claim workers, the questions' and, on
/// PostgreSQL, the listener.
pub fn spawn(
    cfg: FleetConfig,
    inbox: Tell<Report>,
    batched: BatchObserver,
) -> Result<Handle, FleetError> {
    let (nudge, nudged) = std::sync::mpsc::channel();
    if !cfg.url.starts_with("sqlite:") {
        let listener = berth_store::fleet::PgFleet::lazy(&cfg.url)?.listener();
        spawn_listener(listener, inbox.clone(), nudge.clone());
    }
    let (questions, asked) = std::sync::mpsc::sync_channel::<Question>(QUESTIONS_MAX);
    check_id_at_start(&cfg)?;
    let mut answering = open(&cfg.url)?;
    thread("berth-fleet-ask", move || {
        while let Ok(q) = asked.recv() {
            q(&mut *answering);
        }
    })?;
    let common = Common::new(cfg, inbox, Arc::new(crate::clock::mono_ms), batched);
    let (status, invalidations) = (common.status.clone(), common.invalidations.clone());
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    let rx = Arc::new(Mutex::new(rx));
    for _ in 0..CLAIM_WORKERS {
        let mut w = Worker {
            store: open(&common.cfg.url)?,
            common: common.clone(),
        };
        let rx = rx.clone();
        thread("berth-fleet-claim", move || loop {
            // The first job waited for, then whatever else has gathered.
            let jobs = {
                let rx = rx.lock().unwrap_or_else(|e| e.into_inner());
                let Ok(first) = rx.recv() else { return };
                let mut jobs = vec![first];
                jobs.extend(rx.try_iter().take(BATCH_OPS_MAX - 1));
                jobs
            };
            w.jobs(jobs);
        })?;
    }
    let (first_tx, first_rx) = std::sync::mpsc::channel();
    let w = Worker {
        store: open(&common.cfg.url)?,
        common,
    };
    thread("berth-fleet", move || w.run(first_tx, nudged))?;
    // The host registers before it serves, so its first requests find it in the
    // fleet; a database that does not answer in time leaves it serving unregistered
    // (new runs refused with 503) while the thread keeps trying.
    let _ = first_rx.recv_timeout(Duration::from_millis(FIRST_REGISTRATION_WAIT_MS));
    Ok(Handle {
        tx,
        questions,
        nudge,
        status,
        invalidations,
    })
}

fn thread(name: &str, f: impl FnOnce() + Send + 'static) -> Result<(), FleetError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(|_| ())
        .map_err(|e| FleetError::Unavailable(format!("fleet thread: {e}")))
}

/// How long a starting host waits for its first registration before it serves anyway.
const FIRST_REGISTRATION_WAIT_MS: u64 = 5_000;

fn spawn_listener(
    mut l: berth_store::fleet::PgListener,
    inbox: Tell<Report>,
    nudge: std::sync::mpsc::Sender<()>,
) {
    let _ = thread("berth-fleet-listen", move || loop {
        match l.wait(Duration::from_millis(LISTEN_WAIT_MS)) {
            Ok(mut payloads) if !payloads.is_empty() => {
                // Another host changed the fleet's tokens or drain: the heartbeat
                // thread reads them now (its connection; this one only listens).
                let before = payloads.len();
                payloads.retain(|p| p != SHARED_PAYLOAD);
                if payloads.len() != before {
                    let _ = nudge.send(());
                }
                if !payloads.is_empty() && !inbox.send(Report::Wake { payloads }) {
                    return;
                }
            }
            Ok(_) => {
                if !inbox.alive() {
                    return;
                }
            }
            Err(e) => {
                tracing::debug!("fleet listener: {e}");
                std::thread::sleep(Duration::from_millis(LISTEN_WAIT_MS));
            }
        }
    });
}

/// What the fleet threads share.
struct Common {
    cfg: FleetConfig,
    status: Arc<Status>,
    inbox: Tell<Report>,
    /// Endings the store missed (it was away), retried at each heartbeat.
    ends: Mutex<std::collections::VecDeque<(String, i64, Ending)>>,
    /// Whether the outage was logged (one line per outage, not per call).
    down_logged: AtomicBool,
    /// Another live instance registered under this host's id (issue 38 item 8): this
    /// host does not register again until it is restarted.
    ousted: AtomicBool,
    clock: Clock,
    batched: BatchObserver,
    /// The version of the fleet's tokens and drain last told to the daemon (-1: none
    /// yet).
    shared_version: AtomicI64,
    /// Evidence invalidations the store missed (it was away), retried at each
    /// heartbeat (see [`SharedJob`]).
    invalidations: Missed,
}

impl Common {
    fn new(
        cfg: FleetConfig,
        inbox: Tell<Report>,
        clock: Clock,
        batched: BatchObserver,
    ) -> Arc<Common> {
        let status = Arc::new(Status::default());
        status.enabled.store(true, Ordering::Relaxed);
        *status.host_id.lock().unwrap_or_else(|e| e.into_inner()) = cfg.host.host_id.clone();
        Arc::new(Common {
            cfg,
            status,
            inbox,
            ends: Mutex::default(),
            down_logged: AtomicBool::new(false),
            ousted: AtomicBool::new(false),
            clock,
            batched,
            shared_version: AtomicI64::new(-1),
            invalidations: Missed::default(),
        })
    }

    /// Tells the daemon how this host stands with the store (`Report::Status`).
    fn tell_status(&self) -> bool {
        self.inbox.send(Report::Status {
            available: self.status.available(),
            gen: self.status.gen(),
            beat_ok_ms: self.status.beat_ok_ms.load(Ordering::Relaxed),
        })
    }

    /// Notes how the store answered: available or not (logged once per change, and
    /// told to the daemon once per change).
    fn seen<T>(&self, r: &Result<T, FleetError>) {
        let ok = !matches!(r, Err(FleetError::Unavailable(_)));
        if self.status.available.swap(ok, Ordering::Relaxed) != ok {
            self.tell_status();
        }
        let logged = self.down_logged.swap(!ok, Ordering::Relaxed);
        match r {
            Err(e) if !ok && !logged => {
                tracing::warn!("fleet store unavailable: {e}; local runs go on, new fleet-wide claims are refused until it is back");
            }
            _ if ok && logged => tracing::info!("fleet store available again"),
            _ => {}
        }
    }

    fn missed(&self, run_id: String, gen: i64, how: Ending) {
        let mut ends = self.ends.lock().unwrap_or_else(|e| e.into_inner());
        if push_bounded(&mut ends, ENDS_PENDING_MAX, (run_id, gen, how)).is_some() {
            tracing::warn!("fleet: too many endings waiting for the store; the oldest is left to the dead-host rules");
        }
    }
}

/// A fleet thread with its own connection: the heartbeat's, or a claim worker's.
struct Worker {
    store: Box<dyn FleetStore>,
    common: Arc<Common>,
}

impl Worker {
    /// Beats every `beat_ms`; between beats, a nudge (another host announced a change
    /// of the fleet's tokens or drain) reads them at once.
    fn run(mut self, first: std::sync::mpsc::Sender<()>, nudged: std::sync::mpsc::Receiver<()>) {
        use std::sync::mpsc::RecvTimeoutError;
        let period = Duration::from_millis(self.common.cfg.beat_ms);
        let mut alive = self.beat();
        let _ = first.send(());
        let mut next = std::time::Instant::now() + period;
        while alive {
            let left = next.saturating_duration_since(std::time::Instant::now());
            match nudged.recv_timeout(left) {
                Ok(()) => {
                    while nudged.try_recv().is_ok() {}
                    alive = self.sync_shared();
                }
                Err(e) => {
                    if e == RecvTimeoutError::Disconnected {
                        std::thread::sleep(left);
                    }
                    alive = self.beat();
                    next = std::time::Instant::now() + period;
                }
            }
        }
    }

    /// Reads the fleet's tokens and drain if they changed since the version last told,
    /// and tells the daemon. False once the daemon is gone.
    fn sync_shared(&mut self) -> bool {
        let c = self.common.clone();
        self.read_shared().unwrap_or_else(|_| c.inbox.alive())
    }

    /// [`Worker::sync_shared`], with the store's refusal: `Ok(alive)`.
    fn read_shared(&mut self) -> Result<bool, FleetError> {
        let c = self.common.clone();
        let r = self.store.shared(c.shared_version.load(Ordering::Relaxed));
        c.seen(&r);
        Ok(match r? {
            Some(sh) => {
                c.shared_version.store(sh.version, Ordering::Relaxed);
                c.inbox.send(Report::Shared(sh))
            }
            None => c.inbox.alive(),
        })
    }

    /// Carries out `jobs` (at most `BATCH_OPS_MAX`) as one batch and reports each
    /// one's answer: a claim's to the daemon, an ending the store missed kept for the
    /// next heartbeat's retry.
    fn jobs(&mut self, jobs: Vec<Job>) {
        let c = self.common.clone();
        let answers = self.store.batch(&c.cfg.host.host_id, &jobs);
        c.seen(&answers);
        let answers = match answers {
            Ok(answers) => {
                (c.batched)(jobs.len());
                answers
            }
            Err(e) => {
                let e = e.to_string();
                let lost = || Err(FleetError::Unavailable(e.clone()));
                jobs.iter().map(|_| lost()).collect()
            }
        };
        let mut claimed = Vec::new();
        for (job, answer) in jobs.into_iter().zip(answers) {
            if let Job::End { run_id, gen, how } = job {
                if answer.is_err() {
                    c.missed(run_id, gen, how);
                }
                continue;
            }
            let result = answer.and_then(|a| match a {
                OpOutcome::Claim(o) => Ok(o),
                OpOutcome::Ended(_) => Err(FleetError::Unavailable(
                    "the store answered a claim as an ending".into(),
                )),
            });
            claimed.push(ClaimAnswer {
                run_id: job.run_id().to_owned(),
                gen: job.gen(),
                result,
            });
        }
        if !claimed.is_empty() {
            c.inbox.send(Report::Claimed(claimed));
        }
    }

    /// Registers this host (again), its fence sequence raised first; false once the
    /// daemon is gone. Not while another instance holds its id (issue 38 item 8).
    fn register(&mut self) -> bool {
        let c = self.common.clone();
        let host = c.cfg.host.host_id.as_str();
        if c.ousted.load(Ordering::Relaxed) {
            return c.inbox.alive();
        }
        // Fences from the fleet's sequence are this host's only fences (issue 38
        // item 1): above any it gave before, or it would refuse every permit.
        let raised = self.store.raise_fence(c.cfg.fence_floor);
        c.seen(&raised);
        if let Err(e) = raised {
            tracing::warn!(
                "fleet: raising the fence sequence to this host's last fence {}: {e}",
                c.cfg.fence_floor
            );
            return c.inbox.alive();
        }
        // The fleet's tokens and drain before the registration (so before the first
        // claim: a host that starts during a fleet drain admits nothing new), and not
        // between it and the next heartbeat: a slow read there made the host count
        // itself away at its first acquire (the relay tests caught it).
        match self.read_shared() {
            Ok(true) => {}
            Ok(false) => return false,
            Err(_) => return c.inbox.alive(),
        }
        let r = self.store.register(&c.cfg.host);
        c.seen(&r);
        if let Ok((gen, resumed)) = r {
            c.status.gen.store(gen, Ordering::Relaxed);
            c.status.beat_ok_ms.store((c.clock)(), Ordering::Relaxed);
            tracing::info!(host, gen, resumed, "fleet: registered");
            // The store just answered; if it fails now, the claims are looked at
            // again at the next registration.
            let claims = match resumed {
                true => self.store.claims_of(host).unwrap_or_default(),
                false => Vec::new(),
            };
            let claims = claims.into_iter().map(|(run_id, _)| run_id).collect();
            let report = Report::Generation {
                gen,
                resumed,
                claims,
            };
            return c.tell_status() && c.inbox.send(report);
        }
        c.inbox.alive()
    }

    /// One heartbeat: register if needed, beat, retry endings, declare lapsed hosts
    /// dead. False once the daemon is gone.
    fn beat(&mut self) -> bool {
        let c = self.common.clone();
        let (host, gen) = (c.cfg.host.host_id.as_str(), c.status.gen());
        if gen == 0 {
            return self.register();
        }
        let load = c
            .status
            .load
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let r = self.store.heartbeat(host, gen, &load);
        c.seen(&r);
        match r {
            Ok(true) => {
                c.status.beat_ok_ms.store((c.clock)(), Ordering::Relaxed);
                c.tell_status();
            }
            Ok(false) => {
                self.lost_generation(host, gen);
                c.status.gen.store(0, Ordering::Relaxed);
                return c.tell_status() && self.sync_shared();
            }
            Err(_) => return c.inbox.alive(),
        }
        self.retry_ends(host);
        self.retry_invalidations();
        let lapse = i64::try_from(c.cfg.lapse_ms).unwrap_or(i64::MAX);
        let r = self.store.declare_dead(host, lapse);
        c.seen(&r);
        for (h, g) in r.unwrap_or_default() {
            tracing::warn!(host = h, gen = g, by = host, "fleet: declared a host dead (no heartbeat within the lapse): its keys are freed and its budget tokens marked lapsed");
            if !c.inbox.send(Report::Declared { host_id: h, gen: g }) {
                return false;
            }
        }
        self.sync_shared()
    }

    /// This host's generation is gone. Declared dead while away (F2): nothing it held
    /// comes back, and it re-registers under a new generation at the next beat. Or
    /// another live instance registered under its id (issue 38 item 8: the two took
    /// the id from each other at every heartbeat, and their runs' acquires expired):
    /// this one stays out of the fleet (new fleet-wide claims get 503) and says so.
    fn lost_generation(&mut self, host: &str, gen: i64) {
        let other = self.store.hosts().ok().and_then(|hs| {
            hs.into_iter()
                .find(|h| h.host_id == host && h.alive && h.gen != gen)
        });
        match other {
            Some(o) => {
                tracing::error!(
                    host,
                    gen,
                    "fleet: host id {host} was taken by another live berth at {} (generation {}); this host stays out of the fleet (new fleet-wide claims get 503) until it is restarted with another --host-id",
                    o.address,
                    o.gen
                );
                self.common.ousted.store(true, Ordering::Relaxed);
            }
            None => tracing::warn!(
                host,
                gen,
                "fleet: this host was declared dead; re-registering under a new generation"
            ),
        }
    }

    /// Evidence invalidations the store missed, oldest first, until one fails again
    /// (at most `INVALIDATIONS_PER_BEAT_MAX` a beat).
    fn retry_invalidations(&mut self) {
        let missed = self.common.invalidations.clone();
        for _ in 0..INVALIDATIONS_PER_BEAT_MAX {
            let next = missed.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
            let Some(job) = next else { return };
            let r = job.carry_out(&mut *self.store);
            self.common.seen(&r);
            match r {
                Err(FleetError::Unavailable(_)) => {
                    missed
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push_front(job);
                    return;
                }
                Err(e) => tracing::warn!(?job, "fleet: the store did not take it: {e}"),
                Ok(_) => {}
            }
        }
    }

    /// Endings the store missed, oldest first, a batch (one round trip) at a time and
    /// at most `ENDS_RETRY_BATCHES_PER_BEAT` batches a beat, until the store fails
    /// again. One round trip each, as they were, a long queue after an outage held the
    /// heartbeat's thread for seconds, long enough to make the host stale (and its
    /// runs with fleet-wide claims fenced) just as the store came back.
    fn retry_ends(&mut self, host: &str) {
        for _ in 0..ENDS_RETRY_BATCHES_PER_BEAT {
            let ops: Vec<Job> = {
                let mut ends = self.common.ends.lock().unwrap_or_else(|e| e.into_inner());
                let n = ends.len().min(BATCH_OPS_MAX);
                ends.drain(..n)
                    .map(|(run_id, gen, how)| Job::End { run_id, gen, how })
                    .collect()
            };
            if ops.is_empty() {
                return;
            }
            let r = self.store.batch(host, &ops);
            self.common.seen(&r);
            match r {
                Ok(answers) => {
                    for (op, a) in ops.iter().zip(answers) {
                        if let Err(e) = a {
                            tracing::warn!(?op, "fleet: the store refused a missed ending: {e}");
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!("fleet: missed endings wait for the store: {e}");
                    let mut ends = self.common.ends.lock().unwrap_or_else(|e| e.into_inner());
                    for op in ops.into_iter().rev() {
                        if let Job::End { run_id, gen, how } = op {
                            ends.push_front((run_id, gen, how));
                        }
                    }
                    return;
                }
            }
        }
    }
}

/// Fleet mode without threads, for the daemon simulator: the link the daemon holds, and
/// the worker that the simulator runs by hand (claims and endings when it chooses,
/// heartbeats when it chooses), on its store, at its time.
#[cfg(test)]
pub struct SimLink {
    worker: Worker,
    jobs: std::sync::mpsc::Receiver<Job>,
    /// What the daemon told the store without waiting (`Handle::share`), carried out
    /// when the simulator chooses.
    asked: std::sync::mpsc::Receiver<Question>,
    /// Taken from `jobs` to look at, not carried out yet.
    buffered: std::collections::VecDeque<Job>,
}

#[cfg(test)]
impl SimLink {
    pub fn new(
        cfg: FleetConfig,
        store: Box<dyn FleetStore>,
        inbox: Tell<Report>,
        clock: Clock,
    ) -> (Handle, SimLink) {
        let common = Common::new(cfg, inbox, clock, Arc::new(|_| {}));
        let status = common.status.clone();
        let (tx, jobs) = std::sync::mpsc::channel();
        // The simulator asks the store itself; what the daemon tells it waits here.
        let (questions, asked) = std::sync::mpsc::sync_channel(QUESTIONS_MAX);
        let (nudge, _) = std::sync::mpsc::channel();
        let handle = Handle {
            tx,
            questions,
            nudge,
            status,
            invalidations: common.invalidations.clone(),
        };
        let worker = Worker { store, common };
        let buffered = Default::default();
        (
            handle,
            SimLink {
                worker,
                jobs,
                asked,
                buffered,
            },
        )
    }

    /// One heartbeat (a registration first, if the host has no generation).
    pub fn beat(&mut self) {
        self.worker.beat();
    }

    /// Carries out what the daemon told the store (its promotion evidence).
    pub fn told(&mut self) {
        for q in self.asked.try_iter() {
            q(&mut *self.worker.store);
        }
    }

    /// Carries out the oldest `n` jobs the daemon sent (fewer if there are not as
    /// many) as one batch; how many there were.
    pub fn jobs(&mut self, n: usize) -> usize {
        self.buffered.extend(self.jobs.try_iter());
        let n = n.min(self.buffered.len()).min(BATCH_OPS_MAX);
        if n > 0 {
            self.worker.jobs(self.buffered.drain(..n).collect());
        }
        n
    }

    /// Carries out every job the daemon sent, in batches; false if there was none.
    pub fn all_jobs(&mut self) -> bool {
        let mut any = false;
        while self.jobs(BATCH_OPS_MAX) > 0 {
            any = true;
        }
        any
    }

    /// Jobs the daemon sent that the link has not carried out.
    pub fn has_jobs(&mut self) -> bool {
        self.buffered.extend(self.jobs.try_iter());
        !self.buffered.is_empty()
    }

    /// Endings the store missed (it was away), kept for the next heartbeat's retry.
    pub fn missed_ends(&self) -> usize {
        let ends = self.worker.common.ends.lock();
        ends.unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// The outcome of a claim, as the daemon reads it.
pub type ClaimResult = Result<ClaimOutcome, FleetError>;

/// The store's answer to a run's claim (or re-fence), under the generation it was sent
/// with.
#[derive(Debug)]
pub struct ClaimAnswer {
    pub run_id: String,
    pub gen: i64,
    pub result: ClaimResult,
}

/// What the fleet threads tell the daemon (`Msg::Fleet`).
#[derive(Debug)]
pub enum Report {
    /// F1: the store's answers to one batch's claims, in the batch's order: one
    /// message, so the daemon takes them in one step (one wake-up a batch, not one a
    /// claim).
    Claimed(Vec<ClaimAnswer>),
    /// F3: fleet-wide claims came free (`token SCOPE/HARNESS`, `key NAME`).
    Wake { payloads: Vec<String> },
    /// F2: this host registered under generation `gen`; `resumed` is false if its
    /// previous generation had been declared dead. `claims`: the runs whose claims it
    /// holds now (moved to `gen`), for the daemon to end those whose runs ended.
    Generation {
        gen: i64,
        resumed: bool,
        claims: Vec<String>,
    },
    /// F2: this host declared another host dead.
    Declared { host_id: String, gen: i64 },
    /// F1/F2: how this host stands with the store, told whenever it changes: whether
    /// the store answers, its generation (0: not registered), and when (monotonic ms)
    /// a heartbeat was last accepted. The daemon decides from these, never from the
    /// shared [`Status`] (which the API reads).
    Status {
        available: bool,
        gen: i64,
        beat_ok_ms: u64,
    },
    /// Issue 38 Build 3: the fleet's bearer tokens and drain changed (or were read for
    /// the first time): the daemon mirrors them.
    Shared(Shared),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Endings and invalidations the store missed wait in a bounded queue: the oldest
    /// goes to make room, and the queue never grows past its bound.
    #[test]
    fn a_missed_queue_drops_its_oldest_at_its_bound() {
        let mut q = std::collections::VecDeque::new();
        assert_eq!(push_bounded(&mut q, 2, 1), None);
        assert_eq!(push_bounded(&mut q, 2, 2), None);
        assert_eq!(push_bounded(&mut q, 2, 3), Some(1));
        assert_eq!(q, [2, 3]);
    }

    /// Issue 38 item 7: `--ttl-max 20s --fleet-margin 10s` with the default 10 s grace.
    /// The fence came at three quarters of the lapse (22.5 s), and a child ignoring
    /// SIGTERM was killed at 32.5 s, 2.5 s after another host could take its key.
    #[test]
    fn regression_the_self_fence_leaves_the_stop_grace_before_the_lapse() {
        let (lapse, beat, grace) = (30_000, 1_000, 10_000);
        let fence = self_fence_ms(lapse, beat, grace).unwrap();
        assert!(
            fence + grace < lapse,
            "fenced at {fence} ms, killed at {} ms, after the {lapse} ms lapse",
            fence + grace
        );
        assert_eq!(fence, lapse - grace - 2 * beat);
        // A long lapse keeps its quarter.
        assert_eq!(self_fence_ms(600_000, 1_000, 10_000).unwrap(), 450_000);
    }

    fn cfg(id: &str) -> FleetConfig {
        FleetConfig {
            url: "mem".into(),
            host: HostInfo {
                host_id: id.into(),
                address: format!("http://{id}-second"),
                version: "test".into(),
            },
            beat_ms: 1_000,
            lapse_ms: 30_000,
            recheck_ms: 2_000,
            fence_floor: 0,
        }
    }

    /// Issue 38 item 8: two daemons with one id took it from each other at every
    /// heartbeat. A second one is refused while the first beats, naming the id and the
    /// first's address; a silent row (a kill -9 of this host, a dead host) is taken
    /// over, and so is an id nobody holds.
    #[test]
    fn regression_a_host_id_held_by_a_live_instance_is_refused() {
        use berth_store::fleet::MemFleet;
        let clock = Arc::new(AtomicU64::new(1_000));
        let store = MemFleet::with_clock(clock.clone());
        let mut first = store.clone();
        let mut info = cfg("dup").host;
        info.address = "http://first:7420".into();
        let (gen, _) = first.register(&info).unwrap();
        // The first instance beats while the second one watches.
        let beating = |d: Duration| {
            let mut f = store.clone();
            for _ in 0..d.as_millis() / 1_000 {
                clock.fetch_add(1_000, Ordering::SeqCst);
                assert!(f.heartbeat("dup", gen, "{}").unwrap());
            }
        };
        let mut second = store.clone();
        let e = check_id_free(&mut second, &cfg("dup"), beating).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("dup") && e.contains("http://first:7420"), "{e}");
        // Silent: its own previous life, or a dead host.
        let silent = |d: Duration| {
            clock.fetch_add(d.as_millis() as u64, Ordering::SeqCst);
        };
        check_id_free(&mut second, &cfg("dup"), silent).unwrap();
        check_id_free(&mut second, &cfg("free"), |_| panic!("no row to watch")).unwrap();
    }

    /// Missed endings go back to the store a batch (one round trip) at a time, at most
    /// `ENDS_RETRY_BATCHES_PER_BEAT` batches a heartbeat: one round trip each, a long
    /// queue after an outage held the heartbeat's thread for seconds.
    #[test]
    fn missed_endings_are_retried_in_batches_a_few_a_beat() {
        use berth_store::fleet::MemFleet;
        let clock = Arc::new(AtomicU64::new(1_000));
        let store = MemFleet::with_clock(clock.clone());
        let now = Arc::new(move || clock.load(Ordering::Relaxed));
        let inbox = Tell::to_fn(|_| true);
        let (_handle, mut link) = SimLink::new(cfg("a"), Box::new(store), inbox, now);
        link.beat();
        let per_beat = ENDS_RETRY_BATCHES_PER_BEAT * BATCH_OPS_MAX;
        for i in 0..per_beat + 10 {
            let c = &link.worker.common;
            c.missed(format!("r{i}"), 1, Ending::Released);
        }
        link.beat();
        assert_eq!(link.missed_ends(), 10, "one beat's worth");
        link.beat();
        assert_eq!(link.missed_ends(), 0);
    }

    #[test]
    fn a_lapse_too_short_for_the_grace_is_refused_naming_the_flags() {
        let e = self_fence_ms(8_000, 1_000, 10_000).unwrap_err();
        for flag in ["--ttl-max", "--fleet-margin", "--stop-grace"] {
            assert!(e.contains(flag), "{flag} not named: {e}");
        }
        // Three heartbeats of silence at least before the fence.
        assert!(self_fence_ms(14_000, 1_000, 10_000).is_err());
        assert_eq!(self_fence_ms(15_000, 1_000, 10_000), Ok(3_000));
    }
}
