//! A11: why a run waits, in words a person can act on. A pass records a [`Blocker`]
//! (no strings); its stable code and its message are rendered only when asked, from
//! the engine's state at that moment.

use std::borrow::Cow;

use crate::command::PressureKind;
use crate::engine::{concurrency_class, Blocker, Engine, KeyId, CPU, DISK, MEMORY, SLOTS};
use crate::scopes::Block;
use crate::types::{fmt_bytes, ConcurrencyClass, Reason};

impl Engine {
    pub(crate) fn render_blocker(&self, b: Blocker) -> Reason {
        Reason {
            code: b.code(self).into_owned(),
            message: b.render(self),
        }
    }
}

impl Blocker {
    /// The stable code (`capacity.memory`, `key.exclusive`, ...): clients branch on it.
    pub(crate) fn code(&self, e: &Engine) -> Cow<'static, str> {
        Cow::Borrowed(match self {
            Blocker::ForegroundWaiting => "priority.foreground_waiting",
            Blocker::Upgrade(_) => "key.upgrade_pending",
            Blocker::ExclusiveHeld(..) => "key.exclusive",
            Blocker::SharedHeld(..) => "key.shared",
            Blocker::WriterWaiting(_) => "key.writer_waiting",
            Blocker::Resource { res, .. } => match *res {
                SLOTS => "capacity.slots",
                MEMORY => "capacity.memory",
                CPU => "capacity.cpu",
                DISK => "capacity.disk",
                named => return Cow::Owned(format!("capacity.{}", e.res_names[named])),
            },
            Blocker::Ambient { .. } => "capacity.memory",
            Blocker::Budget(_, block) => match block {
                Block::Full { .. } => "budget.full",
                Block::Paused => "scope.paused",
                Block::Stopped => "scope.stopped",
                Block::Conflict => "budget.conflict",
                Block::HostFull => "budget.host_full",
            },
            Blocker::Permit => "fleet.claim",
            Blocker::Draining => "host.draining",
            Blocker::Pressure { kind, .. } => match kind {
                PressureKind::Memory => "host.memory_pressure",
                PressureKind::Cpu => "host.cpu_pressure",
                PressureKind::Io => "host.io_pressure",
            },
            Blocker::Disk { .. } => "host.disk_pressure",
            Blocker::Guard { .. } => "queue.starvation_guard",
        })
    }

    /// The message: what blocks the run, named (the holder, the figures, the scope).
    pub(crate) fn render(&self, e: &Engine) -> String {
        match *self {
            Blocker::ForegroundWaiting => format!(
                "{} foreground run(s) waiting; background runs only use spare capacity",
                e.queues[0].len()
            ),
            Blocker::Upgrade(k) => {
                let by = e.key(k).upgrades.front();
                let by = by.map_or("?", |&u| e.run(u).req.run_id.as_str());
                format!(
                    "{} is being taken back exclusively by run {by}",
                    e.describe_key(k)
                )
            }
            Blocker::ExclusiveHeld(k, h) => exclusive_held(e, k, &e.run(h).req.run_id),
            Blocker::SharedHeld(k, n) => format!(
                "{} is held shared by {n} run(s); this run needs it alone",
                e.describe_key(k)
            ),
            Blocker::WriterWaiting(k) => format!(
                "an exclusive claim on {} is queued; shared claims wait behind it",
                e.describe_key(k)
            ),
            Blocker::Resource { res, need, free } => resource(e, res, need, free),
            Blocker::Ambient { need, free } => format!(
                "needs {}, {} free under the {} host reserve",
                fmt_bytes(need),
                fmt_bytes(free),
                fmt_bytes(e.live_memory_reserve())
            ),
            Blocker::Disk { need, free } => format!(
                "disk: needs {}, {} free on the workspaces' file system under the {} reserve and the claims of runs just granted",
                fmt_bytes(need),
                fmt_bytes(free),
                fmt_bytes(e.cfg.disk_reserve)
            ),
            Blocker::Budget(s, block) => budget(e, s, block),
            Blocker::Permit => "waiting for its fleet-wide claim (run id, fence, budget token, \
                                fleet keys) from the fleet store"
                .into(),
            Blocker::Draining => {
                "the host is draining: nothing new is granted until the drain ends".into()
            }
            Blocker::Pressure { kind, bp, max } => format!(
                "the host is under {k} pressure: some task stalled on {k} {} of the \
                 last 10 s, over the {} this run's priority is admitted under",
                crate::fmt_bp(bp),
                crate::fmt_bp(max),
                k = kind.as_str()
            ),
            Blocker::Guard { head } => {
                let h = e.run(head);
                format!(
                    "run {} has waited {} s at the head; what it needs is held back for it",
                    h.req.run_id,
                    e.now.saturating_sub(h.enqueued_at) / 1000
                )
            }
        }
    }
}

/// A key held alone by `holder`; a project's runtime key says why the project is
/// serial (its concurrency class, C2).
fn exclusive_held(e: &Engine, k: KeyId, holder: &str) -> String {
    let name = &e.key(k).name;
    let Some(p) = name
        .strip_prefix("project:")
        .and_then(|x| x.strip_suffix(":runtime"))
    else {
        return format!("{} is held exclusively by run {holder}", e.describe_key(k));
    };
    let class = e
        .project_ids
        .get(p)
        .map_or(ConcurrencyClass::Serial, |&id| {
            concurrency_class(e.project(id))
        });
    match class {
        ConcurrencyClass::Serial => format!("project {p} is serial; run {holder} holds it"),
        ConcurrencyClass::ParallelCandidate => format!(
            "project {p} runs serially until a run proves it parallel; run {holder} holds it"
        ),
        ConcurrencyClass::ParallelSafe => {
            format!("project {p}'s runtime is held exclusively by run {holder}")
        }
    }
}

/// A resource short: what is needed against what is free of the allocatable total.
fn resource(e: &Engine, res: usize, need: u64, free: u64) -> String {
    let (name, total) = (&e.res_names[res], e.allocatable[res]);
    match res {
        MEMORY | DISK => format!(
            "needs {}, {} of {} allocatable {name} free",
            fmt_bytes(need),
            fmt_bytes(free),
            fmt_bytes(total)
        ),
        SLOTS => format!("needs {need} slot(s), {free} of {total} free"),
        CPU => format!("needs {need} cpu millis, {free} of {total} free"),
        _ => format!("needs {need} {name}, {free} of {total} free"),
    }
}

/// Why the run's budget token cannot be taken now (B1–B5).
fn budget(e: &Engine, s: crate::queue::Slot, block: Block) -> String {
    let run = e.run(s);
    let b = run.req.budget.as_deref().expect("a budget blocks");
    match block {
        Block::Full { limit, holders } => format!(
            "scope {}: {holders} of {limit} {} tokens are held",
            b.scope, b.harness
        ),
        Block::Paused => format!("scope {} is paused: no new token until it resumes", b.scope),
        Block::Stopped => format!("scope {} is stopped: it never admits again", b.scope),
        Block::Conflict => format!(
            "its key {}/{} in scope {} holds a token of another harness",
            run.req.run_id,
            b.operation(),
            b.scope
        ),
        Block::HostFull => format!(
            "{} budget tokens are held on this host, its maximum",
            crate::scopes::TOKENS_HOST_MAX
        ),
    }
}
