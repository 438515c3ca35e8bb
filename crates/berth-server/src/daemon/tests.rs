//! The daemon with its real host: what an operator reads in the log.

use super::*;
use crate::clock;
use std::sync::Mutex;
use tokio::sync::oneshot;

/// One event as `Capture` saw it: its level, message and other fields (`Debug`
/// form, strings as they are).
#[derive(Clone, Debug)]
struct Line {
    level: tracing::Level,
    message: String,
    fields: BTreeMap<String, String>,
}

/// A subscriber that keeps every event (no spans are used here).
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Line>>>);

impl Capture {
    fn lines(&self) -> Vec<Line> {
        self.0.lock().unwrap().clone()
    }
}

impl tracing::Subscriber for Capture {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Fields(BTreeMap<String, String>);
        impl tracing::field::Visit for Fields {
            fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
                self.0.insert(f.name().to_string(), v.to_string());
            }
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                self.0.insert(f.name().to_string(), format!("{v:?}"));
            }
        }
        let mut fields = Fields(BTreeMap::new());
        event.record(&mut fields);
        let mut fields = fields.0;
        let message = fields.remove("message").unwrap_or_default();
        self.0.lock().unwrap().push(Line {
            level: *event.metadata().level(),
            message,
            fields,
        });
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// The daemon over the state directory `dir`, as a start restores it.
fn restore(dir: &std::path::Path) -> Live {
    restore_with(dir, berth_core::Config::for_host(4, 8 << 30, 100 << 30))
}

fn restore_with(dir: &std::path::Path, cfg: berth_core::Config) -> Live {
    let store = berth_store::SqliteStore::open_exclusive(&dir.join("ledger.db")).unwrap();
    let runs_dir = workspace::ensure_runs_dir(dir).unwrap();
    let host = RealHost::new(
        &runs_dir,
        workspace::Diagnostics {
            dir: dir.join("diagnostics"),
            run_bytes_max: 1 << 20,
            total_bytes_max: 1 << 30,
            run_entries_max: workspace::DIAGNOSTICS_RUN_ENTRIES_MAX,
            total_entries_max: workspace::DIAGNOSTICS_TOTAL_ENTRIES_MAX,
        },
        crate::private::FenceMarker::open(dir).unwrap(),
        Supervision {
            cgroup_base: None,
            controllers: None,
            policy: Default::default(),
            grace_ms: 1_000,
            kill_wait_ms: 1_000,
        },
    )
    .unwrap();
    let how = Restore {
        cfg,
        same_boot: true,
        reconnect_window_ms: 30_000,
        port_range: (30_000, 30_999),
        threads: Default::default(),
    };
    let now = clock::mono_ms();
    let (d, shell) = Daemon::start_for_test(now, how, Box::new(store), "http://127.0.0.1:1", host);
    Live { d, shell }
}

/// A daemon with its shell, as the runtime drives it: each step's effects carried out.
struct Live {
    d: Daemon<RealHost>,
    shell: super::Shell,
}

impl std::ops::Deref for Live {
    type Target = Daemon<RealHost>;
    fn deref(&self) -> &Daemon<RealHost> {
        &self.d
    }
}

impl std::ops::DerefMut for Live {
    fn deref_mut(&mut self) -> &mut Daemon<RealHost> {
        &mut self.d
    }
}

impl Live {
    fn handle(&mut self, now: u64, msg: Msg) {
        let fx = self.d.handle(now, msg);
        self.shell.carry_out(fx);
    }

    fn tick(&mut self, now: u64, sample: Option<super::Sample>) {
        let fx = self.d.tick(now, sample);
        self.shell.carry_out(fx);
    }

    fn close(self) {
        self.shell.close(self.d);
    }
}

fn acquire(st: &mut Live, run_id: &str, ttl_ms: u64, cpu_millis: u64) -> Result<RunInfo, Error> {
    send_acquire(st, request(run_id, ttl_ms, cpu_millis), false)
}

/// A foreground request for one slot and `cpu_millis`, not waiting.
fn request(run_id: &str, ttl_ms: u64, cpu_millis: u64) -> berth_core::Request {
    berth_core::Request {
        run_id: run_id.into(),
        project: run_id.replace(':', "-"),
        class: berth_core::Class::Managed,
        priority: berth_core::Priority::Foreground,
        resources: berth_core::Resources {
            slots: 1,
            cpu_millis,
            ..Default::default()
        },
        singletons: Vec::new(),
        contract: None,
        ttl_ms,
        wait_ms: 0,
        budget: None,
    }
}

fn send_acquire(st: &mut Live, req: berth_core::Request, detach: bool) -> Result<RunInfo, Error> {
    let (reply, rx) = oneshot::channel();
    st.handle(
        clock::mono_ms(),
        Msg::Acquire {
            req,
            worktree: None,
            labels: BTreeMap::new(),
            stop_grace_ms: None,
            ports: Vec::new(),
            attach: false,
            detach,
            thread: None,
            lease_only: false,
            by: None,
            reply,
        },
    );
    rx.blocking_recv().unwrap()
}

/// The one INFO line whose message starts with `prefix`.
fn info_line(lines: &[Line], prefix: &str) -> Line {
    let found: Vec<&Line> = lines
        .iter()
        .filter(|l| l.level == tracing::Level::INFO && l.message.starts_with(prefix))
        .collect();
    assert_eq!(found.len(), 1, "{prefix}: {lines:#?}");
    found[0].clone()
}

/// What an operator reads: a lease that ran out and an impossible request are INFO
/// lines naming the run; a grant is DEBUG; a restart says what it restored.
#[test]
fn expiry_refusal_and_restart_summary_are_logged_with_the_run_id() {
    let _one = super::LOGGING_TESTS
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cap = Capture::default();
    tracing::subscriber::with_default(cap.clone(), || {
        let mut st = restore(dir.path());
        let exp = acquire(&mut st, "exp-1", 1, 100).unwrap();
        assert_eq!(exp.view.state, RunState::Granted);
        let keep = acquire(&mut st, "keep:2", 600_000, 100).unwrap();
        let never = acquire(&mut st, "huge.3", 600_000, 1_000_000).unwrap_err();
        assert!(
            matches!(never, Error::Core(CoreError::CapacityImpossible { .. })),
            "{never:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
        st.tick(clock::mono_ms(), None);
        assert_eq!(
            st.engine.view_of("exp-1").map(|v| v.state),
            Some(RunState::Expired)
        );
        st.close();
        let lines = cap.lines();

        let l = info_line(&lines, "lease expired");
        assert_eq!(l.fields["run_id"], "exp-1", "{l:?}");
        assert_eq!(l.fields["fence"], exp.view.fence.unwrap().to_string());
        let l = info_line(&lines, "acquire refused (capacity_impossible)");
        assert_eq!(l.fields["run_id"], "huge.3", "{l:?}");
        assert_eq!(l.fields["resource"], "cpu_millis", "{l:?}");
        assert_eq!(l.fields["request"], "1000000", "{l:?}");
        // Grants are DEBUG, with the run id; nothing else about them at INFO.
        for id in ["exp-1", "keep:2"] {
            assert!(
                lines.iter().any(|l| l.level == tracing::Level::DEBUG
                    && l.message == "granted"
                    && l.fields.get("run_id").map(String::as_str) == Some(id)),
                "{id}: {lines:#?}"
            );
        }
        assert!(!lines.iter().any(|l| l.level == tracing::Level::INFO
            && l.fields.get("run_id").map(String::as_str) == Some("keep:2")));
        // Every line about a run names it.
        for l in &lines {
            if l.level <= tracing::Level::INFO && l.message.contains("run") {
                assert!(
                    l.fields.contains_key("run_id") || l.message.starts_with("restored"),
                    "{l:?}"
                );
            }
        }

        // The restart says what it found.
        cap.0.lock().unwrap().clear();
        let st = restore(dir.path());
        let l = info_line(&cap.lines(), "restored from the ledger");
        for (k, v) in [
            ("granted", "1"),
            ("queued", "0"),
            ("releasing", "0"),
            ("degraded", "0"),
            ("ended", "1"),
            ("same_boot", "true"),
        ] {
            assert_eq!(l.fields[k], v, "{k}: {l:?}");
        }
        let last: u64 = l.fields["last_fence"].parse().unwrap();
        assert!(last >= keep.view.fence.unwrap(), "{l:?}");
        st.close();
    });
}

/// A deep queue drains: once the daemon's hold has stayed down for `RELEASE_QUIET_MS`,
/// its host is asked to give the freed memory back, once; not while the queue is deep,
/// not before the quiet period, and not again without another drain.
#[test]
fn memory_is_given_back_once_a_deep_queue_has_drained() {
    // It drives a daemon, which logs: see `LOGGING_TESTS`.
    let _one = super::LOGGING_TESTS
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = berth_core::Config::for_host(4, 8 << 30, 100 << 30);
    cfg.ended_retained_max = 16;
    let mut st = restore_with(dir.path(), cfg);
    // The whole CPU held, then waiters behind it.
    assert_eq!(
        acquire(&mut st, "holder", 600_000, 3_000)
            .unwrap()
            .view
            .state,
        RunState::Granted
    );
    let waiters = RELEASE_DROP_MIN + 100;
    for i in 0..waiters {
        let mut req = request(&format!("w{i}"), 600_000, 1_000);
        req.wait_ms = 600_000;
        let info = send_acquire(&mut st, req, true).unwrap();
        assert_eq!(info.view.state, RunState::Queued);
    }
    let t0 = clock::mono_ms();
    let before = crate::memory::releases();
    st.tick(t0, None);
    st.tick(t0 + RELEASE_QUIET_MS + 1, None);
    assert_eq!(
        crate::memory::releases(),
        before,
        "nothing left: nothing to give back"
    );
    for i in 0..waiters {
        let (reply, rx) = oneshot::channel();
        let cmd = berth_core::Command::Cancel {
            run_id: format!("w{i}"),
        };
        st.handle(
            clock::mono_ms(),
            Msg::Command {
                cmd,
                by: None,
                reply,
            },
        );
        rx.blocking_recv().unwrap().unwrap();
    }
    let t1 = t0 + RELEASE_QUIET_MS + 2;
    st.tick(t1, None);
    st.tick(t1 + RELEASE_QUIET_MS - 1, None);
    assert_eq!(
        crate::memory::releases(),
        before,
        "the drain is not over yet"
    );
    st.tick(t1 + RELEASE_QUIET_MS, None);
    assert_eq!(
        crate::memory::releases(),
        before + 1,
        "given back after the quiet period"
    );
    st.tick(t1 + 10 * RELEASE_QUIET_MS, None);
    assert_eq!(crate::memory::releases(), before + 1, "once per drain");
    st.close();
}

#[test]
fn release_due_weighs_the_drop_and_the_quiet() {
    let h = Held::default();
    let (h, due) = release_due(h, 5_000, 0);
    assert!(!due && h.peak == 5_000);
    // Fallen far, but just now.
    let (h, due) = release_due(h, 100, 10);
    assert!(!due && h.since_ms == 10);
    let (h, due) = release_due(h, 100, 10 + RELEASE_QUIET_MS - 1);
    assert!(!due);
    let (h, due) = release_due(h, 100, 10 + RELEASE_QUIET_MS);
    assert!(due && h.peak == 100, "{h:?}");
    // Fallen less than RELEASE_DROP_MIN below the (new) peak: never.
    let (h, _) = release_due(h, RELEASE_DROP_MIN + 99, 20_000);
    let (_, due) = release_due(h, 100, 20_001 + 10 * RELEASE_QUIET_MS);
    assert!(!due);
}

/// Issue 35: the daemon decides and the shell acts. A step's answers and its commit
/// leave `handle` as effects: nothing is answered, and nothing is in the ledger, until
/// the shell has carried them out (and then the answer follows the commit, D1).
#[test]
fn a_step_answers_nobody_and_writes_nothing_until_its_effects_are_carried_out() {
    let dir = tempfile::tempdir().unwrap();
    let mut st = restore(dir.path());
    let (reply, mut rx) = oneshot::channel();
    let fx = st.d.handle(
        clock::mono_ms(),
        Msg::Acquire {
            req: request("fx-1", 600_000, 100),
            worktree: None,
            labels: BTreeMap::new(),
            stop_grace_ms: None,
            ports: Vec::new(),
            attach: false,
            detach: false,
            thread: None,
            lease_only: false,
            by: None,
            reply,
        },
    );
    assert!(rx.try_recv().is_err(), "answered by the daemon itself");
    assert_eq!(st.shell.commits(), 0, "written by the daemon itself");
    let commits =
        fx.0.iter()
            .filter(|e| matches!(e, super::Effect::Commit(_)))
            .count();
    assert_eq!(commits, 1, "one commit for the grant");
    st.shell.carry_out(fx);
    st.shell.flush();
    assert_eq!(st.shell.commits(), 1);
    let info = rx.try_recv().expect("answered once durable").unwrap();
    assert_eq!(info.view.state, RunState::Granted);
    // A read waits behind the writes before it, and is an effect too.
    let (reply, mut rx) = oneshot::channel();
    let fx = st.d.handle(clock::mono_ms(), Msg::Status { reply });
    assert!(rx.try_recv().is_err());
    st.shell.carry_out(fx);
    st.shell.flush();
    assert!(rx.try_recv().unwrap().is_ok());
    st.close();
}

/// Regression (issue 35, found by the daemon simulator's crashes): a start with a drain
/// in force restored the drain by applying `Command::Drain` and dropping its events,
/// and that apply also ended every lease that ran out while the daemon was down:
/// unjournaled, never recorded in the ledger and never stopped. The drain is now state
/// the engine is restored with, and the lease ends at the first step, like any other.
#[test]
fn a_lease_that_ran_out_while_a_draining_daemon_was_down_ends_on_the_record() {
    let dir = tempfile::tempdir().unwrap();
    let mut st = restore(dir.path());
    acquire(&mut st, "overdue", 1_000, 100).unwrap();
    let (reply, rx) = oneshot::channel();
    let start = Some(("ops".to_string(), "maintenance".to_string()));
    st.handle(clock::mono_ms(), Msg::Drain { start, reply });
    rx.blocking_recv().unwrap().unwrap();
    st.close();
    std::thread::sleep(std::time::Duration::from_millis(1_200));
    let mut st = restore(dir.path());
    assert!(st.engine.is_draining());
    let state = |st: &Live| st.engine.view_of("overdue").map(|v| v.state);
    assert_eq!(
        state(&st),
        Some(RunState::Granted),
        "changed by the start itself"
    );
    let journaled = st.shared.journal.last();
    st.tick(clock::mono_ms(), None);
    st.shell.flush();
    let ended = state(&st);
    assert!(
        matches!(ended, Some(RunState::Releasing | RunState::Expired)),
        "{ended:?}"
    );
    assert!(
        st.shared.journal.last() > journaled,
        "its end is not journaled"
    );
    st.close();
    let mut store =
        berth_store::SqliteStore::open_exclusive(&dir.path().join("ledger.db")).unwrap();
    let ledger = berth_store::Store::load(&mut store, 10).unwrap();
    let rec = ledger.runs.iter().find(|r| r.request.run_id == "overdue");
    assert_eq!(rec.map(|r| r.state), ended, "the ledger disagrees");
}

/// Regression (issue 35, found by the daemon simulator's crashes): a workspace is
/// removed before the commit that ends its run, so a crash between the two left a
/// granted run whose workspace was gone (W1). A start gives it a new one and records
/// it, and removes what the ledger does not know.
#[test]
fn a_granted_run_whose_workspace_is_gone_at_start_gets_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut st = restore(dir.path());
    acquire(&mut st, "cut", 600_000, 100).unwrap();
    let old = st.extras["cut"].workspace.clone().unwrap();
    st.close();
    std::fs::remove_dir_all(&old.path).unwrap();
    let stray = dir.path().join("runs").join("stray");
    std::fs::create_dir(&stray).unwrap();
    let st = restore(dir.path());
    let new = st.extras["cut"].workspace.clone().unwrap();
    assert!(st.host.workspace_present(&new), "{new:?} is not there");
    assert_ne!((new.dev, new.ino), (old.dev, old.ino));
    assert!(!stray.exists(), "a directory no run owns was left in runs/");
    st.close();
    let mut store =
        berth_store::SqliteStore::open_exclusive(&dir.path().join("ledger.db")).unwrap();
    let ledger = berth_store::Store::load(&mut store, 10).unwrap();
    let rec = ledger.runs.iter().find(|r| r.request.run_id == "cut");
    assert_eq!(rec.and_then(|r| r.workspace.clone()), Some(new));
}

/// Regression (issue 35, found by the daemon simulator): when more runs ended in one
/// step than the engine remembers (`ended_retained_max`), the first of them were
/// retired before the step's commit, so their end was never written: the ledger kept
/// them queued (or holding a claim) for good, and a later start refused the ledger
/// as inconsistent when one held a budget token no longer there.
#[test]
fn runs_ended_in_one_step_past_the_ended_limit_are_all_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = berth_core::Config::for_host(4, 8 << 30, 100 << 30);
    cfg.ended_retained_max = 2;
    let mut st = restore_with(dir.path(), cfg.clone());
    acquire(&mut st, "holder", 600_000, 100).unwrap();
    let waiters = ["w1", "w2", "w3", "w4", "w5"];
    for id in waiters {
        let mut req = request(id, 600_000, 100);
        // Behind the holder: one project's managed runs take turns.
        req.project = "holder".into();
        req.wait_ms = 1_000;
        let info = send_acquire(&mut st, req, true).unwrap();
        assert_eq!(info.view.state, RunState::Queued);
    }
    std::thread::sleep(std::time::Duration::from_millis(1_200));
    // One step: every waiter's deadline has passed.
    st.tick(clock::mono_ms(), None);
    st.shell.flush();
    st.close();
    let mut store =
        berth_store::SqliteStore::open_exclusive(&dir.path().join("ledger.db")).unwrap();
    let ledger = berth_store::Store::load(&mut store, 100).unwrap();
    for id in waiters {
        let rec = ledger.runs.iter().find(|r| r.request.run_id == id);
        assert_eq!(rec.map(|r| r.state), Some(RunState::Expired), "{id}");
    }
}

/// The daemon simulator's seed 3024: an acquire under the id of an ended run that the
/// engine forgot in that very step (another run's end, due by then, pushed it out of
/// the `ended_retained_max` it keeps) is a new run. It was taken for the ended run and
/// written under that run's queue sequence; the ledger kept the ended record (D3), and
/// after a restart the acknowledged waiter was gone.
#[test]
fn regression_an_acquire_of_an_id_forgotten_in_the_same_step_is_recorded_as_a_new_run() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = berth_core::Config::for_host(4, 8 << 30, 100 << 30);
    cfg.ended_retained_max = 1;
    let mut st = restore_with(dir.path(), cfg.clone());
    acquire(&mut st, "holder", 600_000, 100).unwrap();
    // Waiters behind the holder (one project's managed runs take turns).
    let waiter = |id: &str| {
        let mut req = request(id, 600_000, 100);
        req.project = "holder".into();
        req.wait_ms = 300;
        req
    };
    let first = send_acquire(&mut st, waiter("again"), true).unwrap();
    assert_eq!(first.view.state, RunState::Queued);
    std::thread::sleep(std::time::Duration::from_millis(400));
    st.tick(clock::mono_ms(), None);
    assert_eq!(
        st.engine.view_of("again").map(|v| v.state),
        Some(RunState::Expired)
    );
    // Another waiter whose deadline passes before the next step.
    send_acquire(&mut st, waiter("doomed"), true).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(400));
    // The step that expires it forgets `again`, and admits the acquire as a new run.
    let second = send_acquire(&mut st, waiter("again"), true).unwrap();
    assert_eq!(second.view.state, RunState::Queued);
    st.shell.flush();
    st.close();
    let mut store =
        berth_store::SqliteStore::open_exclusive(&dir.path().join("ledger.db")).unwrap();
    let ledger = berth_store::Store::load(&mut store, 100).unwrap();
    let again = ledger.runs.iter().find(|r| r.request.run_id == "again");
    assert_eq!(
        again.map(|r| r.state),
        Some(RunState::Queued),
        "the acknowledged waiter"
    );
}

/// Issue 38 Build 3, hostile input: a row in the fleet's token table whose grant is not
/// one berth writes (no `;fleet`, or not a grant at all: a database user's own insert)
/// grants nothing here, while the fleet's real tokens are honoured and kept in the
/// ledger; a later read without them takes them away again.
#[test]
fn a_fleet_token_row_berth_did_not_write_grants_nothing() {
    use berth_store::fleet::{FleetToken, Shared};
    let dir = tempfile::tempdir().unwrap();
    let mut st = restore(dir.path());
    let row = |secret: &str, grant: &str| FleetToken {
        hash: crate::auth::hash_token(secret),
        grant: grant.into(),
        host_id: "elsewhere".into(),
    };
    let read = |version, tokens| {
        Msg::Fleet(crate::fleet::Report::Shared(Shared {
            version,
            drain: None,
            tokens,
            controls: Vec::new(),
            evidence: Vec::new(),
        }))
    };
    let tokens = vec![
        row("real", "operator;fleet"),
        row("planted", "admin"),
        row("garbage", "root;fleet"),
    ];
    st.handle(clock::mono_ms(), read(1, tokens));
    st.shell.flush();
    let known = |st: &Live, secret: &str| {
        let table = st.shared.tokens.read().unwrap();
        crate::auth::lookup(&table, secret)
    };
    assert_eq!(
        known(&st, "real").map(|g| (g.scope, g.fleet)),
        Some((crate::auth::Scope::Operator, true))
    );
    assert_eq!(known(&st, "planted"), None);
    assert_eq!(known(&st, "garbage"), None);
    // Revoked in the fleet: the next read no longer has it.
    st.handle(clock::mono_ms(), read(2, Vec::new()));
    st.shell.flush();
    assert_eq!(known(&st, "real"), None);
    st.close();
    let mut store =
        berth_store::SqliteStore::open_exclusive(&dir.path().join("ledger.db")).unwrap();
    let ledger = berth_store::Store::load(&mut store, 100).unwrap();
    let real = crate::auth::hash_token("real");
    assert!(
        !ledger.tokens.iter().any(|(h, _)| *h == real),
        "revoked from the ledger too"
    );
}
