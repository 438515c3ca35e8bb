//! The journal's vocabulary (D5): an entry ([`JournalEntry`]) and, for each `kind`,
//! the type of its `data` ([`Journal`]). The daemon writes an entry from a `Journal`
//! value, so a kind and its fields are named here and nowhere else; a reader turns an
//! entry's `data` back into its type with [`Journal::parse`]. Every payload type is a
//! schema of the OpenAPI document (`Journal*`), and `x-berth-journal-kinds` on
//! `JournalEntry` maps each kind to its schema.
//!
//! Fields are declared in alphabetical order: an entry's bytes stay what they were
//! when `data` was built as a JSON map. Strings are `Cow`s, so writing the frequent
//! kinds (a lifecycle's four entries) borrows what it shows instead of copying it.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// One journal entry (D5): a line of `GET /v1/journal` and of its export, and the data
/// of each event of `GET /v1/events`. Every state change berth makes is one entry,
/// written in the same transaction as the change; `seq` has no gaps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalEntry {
    pub seq: u64,
    /// RFC 3339: when berth made the change.
    pub at: String,
    /// What happened: `queued`, `granted`, `renewed`, `released`, `expired`,
    /// `stop_started`, `survivors`, `degraded`, `reaped`, `ended`, `refused`,
    /// `token_created`, `process_registered`, `promoted`, ... (every kind, with the
    /// schema of its `data`, is in `x-berth-journal-kinds`).
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    /// The change's own fields (they depend on `kind`): always an object.
    #[serde(default)]
    #[schema(value_type = BTreeMap<String, Value>, required = true)]
    pub data: Value,
}

/// What a reader of the journal wants: entries of one run, one project, some kinds
/// (each left out: all). The daemon filters its streams with it, the CLI the pages it
/// reads.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JournalFilter {
    pub run: Option<String>,
    pub project: Option<String>,
    pub kinds: Vec<String>,
}

impl JournalFilter {
    /// Whether an entry of this run, project and kind is wanted.
    pub fn admits(&self, run_id: Option<&str>, project: Option<&str>, kind: &str) -> bool {
        self.run.as_deref().is_none_or(|r| run_id == Some(r))
            && self.project.as_deref().is_none_or(|p| project == Some(p))
            && (self.kinds.is_empty() || self.kinds.iter().any(|k| k == kind))
    }
}

impl JournalEntry {
    /// `data` as the type of this entry's `kind`: `None` for a kind this client does
    /// not know (a newer daemon's), an error for data that does not fit its kind.
    pub fn typed(&self) -> Option<Result<Journal<'static>, serde_json::Error>> {
        Journal::parse(&self.kind, &self.data)
    }
}

/// A journal entry as the daemon writes it: [`JournalEntry`]'s fields, borrowed, with
/// `data` typed by kind, so writing one builds no `serde_json::Value` (four entries a
/// lifecycle, each a map of keys and strings, cost the daemon thread a tenth of its
/// time). It reads back as a `JournalEntry`.
#[derive(Serialize)]
pub struct JournalLine<'a> {
    pub seq: u64,
    pub at: &'a str,
    pub kind: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub project: Option<&'a str>,
    pub data: &'a Journal<'a>,
}

type Text<'a> = Cow<'a, str>;

/// `queued`: the waiter's position and why it waits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalQueued<'a> {
    pub position: u64,
    pub reason: Option<JournalReason<'a>>,
}

/// Why a waiter waits: a reason's stable code and its message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalReason<'a> {
    #[schema(value_type = String)]
    pub code: Text<'a>,
    #[schema(value_type = String)]
    pub message: Text<'a>,
}

/// `granted`: the fence, when the lease expires, the keys it holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalGranted<'a> {
    #[schema(value_type = String)]
    pub expires_at: Text<'a>,
    pub fence: u64,
    pub keys: Vec<JournalKey<'a>>,
}

/// A key and its mode (`exclusive` or `shared`): a granted run's, or
/// `key_mode_changed`'s.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalKey<'a> {
    #[schema(value_type = String)]
    pub key: Text<'a>,
    #[schema(value_type = String)]
    pub mode: Text<'a>,
}

/// `renewed`: the lease's new expiry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalRenewed<'a> {
    #[schema(value_type = String)]
    pub expires_at: Text<'a>,
}

/// `wait_extended`: the waiter's new deadline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalWaitExtended<'a> {
    #[schema(value_type = String)]
    pub deadline: Text<'a>,
}

/// `released` and `expired`: the fence the run held.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalFence {
    pub fence: Option<u64>,
}

/// `stop_started` (the processes being stopped) and `survivors` (those a stop left).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalPids {
    pub pids: Vec<i32>,
}

/// `degraded`: the processes that survived its stop, if it had any.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalDegraded {
    pub survivors: Option<Vec<i32>>,
}

/// `oom_killed` (issue 36): the kernel's OOM killer killed inside the run's cgroup;
/// its peak against its claim.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalOom {
    pub memory_claim_bytes: u64,
    pub memory_peak_bytes: Option<u64>,
    pub oom_kills: u64,
}

/// `ended`: the final state, and the failure if there was one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalEnded<'a> {
    #[schema(value_type = Option<String>)]
    pub failure: Option<Text<'a>>,
    #[schema(value_type = String)]
    pub state: Text<'a>,
}

/// `promoted`: the evidence that made the project's runs parallel (C3).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalPromoted<'a> {
    #[schema(value_type = Option<String>)]
    pub commit: Option<Text<'a>>,
    #[schema(value_type = String)]
    pub fingerprint: Text<'a>,
    pub ports: Vec<String>,
}

/// A kind with no fields of its own: `evidence_invalidated`, `drain_ended`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalEmpty {}

/// `upgrade_queued` and `upgrade_granted` (C4): the key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalKeyName<'a> {
    #[schema(value_type = String)]
    pub key: Text<'a>,
}

/// `refused`: the refusal's code and message, as the caller was told.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalRefused<'a> {
    #[schema(value_type = String)]
    pub code: Text<'a>,
    #[schema(value_type = String)]
    pub message: Text<'a>,
}

/// `process_registered` (P1): the process's pid.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalPid {
    pub pid: i32,
}

/// `reaped` (P4): the run's state when the reaper took it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalReaped<'a> {
    #[schema(value_type = Option<String>)]
    pub state: Option<Text<'a>>,
}

/// `token_created` and `token_revoked` (S9): the token's id, scope and user, never
/// its secret or its hash.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalToken<'a> {
    #[schema(value_type = String)]
    pub id: Text<'a>,
    #[schema(value_type = String)]
    pub scope: Text<'a>,
    pub uid: Option<u32>,
}

/// `scope_reconciled` (B3): an operator freed `owner`'s tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalScopeReconciled<'a> {
    #[schema(value_type = String)]
    pub by: Text<'a>,
    pub freed: u64,
    #[schema(value_type = String)]
    pub owner: Text<'a>,
    #[schema(value_type = String)]
    pub reason: Text<'a>,
    #[schema(value_type = String)]
    pub scope: Text<'a>,
}

/// `scope_forgotten` (S10): by `operator` or for being `idle`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalScopeForgotten<'a> {
    #[schema(value_type = String)]
    pub by: Text<'a>,
    #[schema(value_type = String)]
    pub scope: Text<'a>,
}

/// `budget_token_taken`, `budget_token_freed` (with `by`: `owner` or `operator`) and
/// `budget_token_lapsed` (without a harness): one budget token (B3).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalBudgetToken<'a> {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub by: Option<Text<'a>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub harness: Option<Text<'a>>,
    #[schema(value_type = String)]
    pub operation_id: Text<'a>,
    #[schema(value_type = String)]
    pub owner: Text<'a>,
    #[schema(value_type = String)]
    pub scope: Text<'a>,
}

/// `scope_frozen` (B1): the scope's policy and manifest, frozen at its first use.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalScopeFrozen<'a> {
    pub manifest: Option<JournalManifest>,
    pub policy: BTreeMap<String, u32>,
    #[schema(value_type = String)]
    pub scope: Text<'a>,
}

/// A frozen manifest (B1), its fields in alphabetical order as every journal object's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalManifest {
    pub execution_ids: Vec<String>,
    pub path: String,
    pub sha256: String,
}

/// `drain_started` (G4): who started the drain, when and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalDrain {
    pub at: String,
    pub by: String,
    pub reason: String,
}

/// `fleet_drain_started` (issue 38 Build 3): the fleet's drain, as this host learnt
/// it: who started it, when, on which host and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalFleetDrain {
    pub at: String,
    pub by: String,
    pub host: String,
    pub reason: String,
}

/// `scope_control` (B4): an accepted pause, stop or resume.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalScopeControl<'a> {
    #[schema(value_type = String)]
    pub control: Text<'a>,
    pub generation: u64,
    #[schema(value_type = String)]
    pub mode: Text<'a>,
    #[schema(value_type = String)]
    pub request_id: Text<'a>,
    #[schema(value_type = String)]
    pub scope: Text<'a>,
}

/// `thread_attached` (G1): the thread's new owner and its registration's budget.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalThreadAttached<'a> {
    #[schema(value_type = String)]
    pub key: Text<'a>,
    pub owner_fence: u64,
    #[schema(value_type = String)]
    pub owner_gen: Text<'a>,
    pub run_budget_ms: u64,
    #[schema(value_type = String)]
    pub run_id: Text<'a>,
}

/// `thread_deadline` (G2): the registration's new deadline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalThreadDeadline<'a> {
    #[schema(value_type = String)]
    pub deadline: Text<'a>,
    #[schema(value_type = String)]
    pub key: Text<'a>,
    #[schema(value_type = String)]
    pub run_id: Text<'a>,
}

/// `thread_detached` (G3): whether the workspace was let go at once.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalThreadDetached<'a> {
    pub evict: bool,
    #[schema(value_type = String)]
    pub key: Text<'a>,
    #[schema(value_type = String)]
    pub run_id: Text<'a>,
}

/// `thread_evicted` and `thread_evict_refused`: the thread, and why (`operator`,
/// `detach`, `idle`, `disk_pressure`, …).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalThreadEviction<'a> {
    #[schema(value_type = String)]
    pub key: Text<'a>,
    #[schema(value_type = String)]
    pub reason: Text<'a>,
}

/// `thread_workspace_created`: the thread's workspace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JournalThreadWorkspace<'a> {
    #[schema(value_type = String)]
    pub key: Text<'a>,
    #[schema(value_type = String)]
    pub workspace: Text<'a>,
}

/// Every kind of journal entry with the type of its `data`: a closed list. A kind is
/// written by the daemon only as one of these, and read back by [`Journal::parse`].
macro_rules! journal_kinds {
    ($($variant:ident($ty:ident $(<$lt:lifetime>)?) = $kind:literal,)*) => {
        /// The `kind` and `data` of a journal entry, as one value.
        #[derive(Clone, Debug, PartialEq, Serialize)]
        #[serde(untagged)]
        pub enum Journal<'a> {
            $($variant($ty $(<$lt>)?),)*
        }

        impl<'a> Journal<'a> {
            /// Every kind, with the name of its data's schema in the OpenAPI document.
            pub const KINDS: &'static [(&'static str, &'static str)] =
                &[$(($kind, stringify!($ty)),)*];

            /// The entry's `kind`.
            pub fn kind(&self) -> &'static str {
                match self {
                    $(Journal::$variant(_) => $kind,)*
                }
            }
        }

        impl Journal<'static> {
            /// `data` read as the type of `kind`; `None` for a kind not in [`Journal::KINDS`].
            pub fn parse(kind: &str, data: &Value) -> Option<Result<Journal<'static>, serde_json::Error>> {
                Some(match kind {
                    $($kind => $ty::deserialize(data.clone()).map(Journal::$variant),)*
                    _ => return None,
                })
            }
        }

        /// Adds every payload's schema to the document's components.
        pub fn journal_schemas(c: utoipa::openapi::ComponentsBuilder) -> utoipa::openapi::ComponentsBuilder {
            c $(.schema_from::<$ty>())*
                .schema_from::<JournalReason>()
                .schema_from::<JournalKey>()
                .schema_from::<JournalManifest>()
        }
    };
}

journal_kinds! {
    Queued(JournalQueued<'a>) = "queued",
    Granted(JournalGranted<'a>) = "granted",
    Renewed(JournalRenewed<'a>) = "renewed",
    WaitExtended(JournalWaitExtended<'a>) = "wait_extended",
    Released(JournalFence) = "released",
    Expired(JournalFence) = "expired",
    StopStarted(JournalPids) = "stop_started",
    Survivors(JournalPids) = "survivors",
    Degraded(JournalDegraded) = "degraded",
    OomKilled(JournalOom) = "oom_killed",
    Ended(JournalEnded<'a>) = "ended",
    Promoted(JournalPromoted<'a>) = "promoted",
    EvidenceInvalidated(JournalEmpty) = "evidence_invalidated",
    KeyModeChanged(JournalKey<'a>) = "key_mode_changed",
    UpgradeQueued(JournalKeyName<'a>) = "upgrade_queued",
    UpgradeGranted(JournalKeyName<'a>) = "upgrade_granted",
    Refused(JournalRefused<'a>) = "refused",
    ProcessRegistered(JournalPid) = "process_registered",
    Reaped(JournalReaped<'a>) = "reaped",
    TokenCreated(JournalToken<'a>) = "token_created",
    TokenRevoked(JournalToken<'a>) = "token_revoked",
    ScopeReconciled(JournalScopeReconciled<'a>) = "scope_reconciled",
    ScopeForgotten(JournalScopeForgotten<'a>) = "scope_forgotten",
    BudgetTokenTaken(JournalBudgetToken<'a>) = "budget_token_taken",
    BudgetTokenFreed(JournalBudgetToken<'a>) = "budget_token_freed",
    BudgetTokenLapsed(JournalBudgetToken<'a>) = "budget_token_lapsed",
    ScopeFrozen(JournalScopeFrozen<'a>) = "scope_frozen",
    ScopeControl(JournalScopeControl<'a>) = "scope_control",
    ThreadAttached(JournalThreadAttached<'a>) = "thread_attached",
    ThreadDeadline(JournalThreadDeadline<'a>) = "thread_deadline",
    ThreadDetached(JournalThreadDetached<'a>) = "thread_detached",
    ThreadEvicted(JournalThreadEviction<'a>) = "thread_evicted",
    ThreadEvictRefused(JournalThreadEviction<'a>) = "thread_evict_refused",
    ThreadWorkspaceCreated(JournalThreadWorkspace<'a>) = "thread_workspace_created",
    DrainStarted(JournalDrain) = "drain_started",
    DrainEnded(JournalEmpty) = "drain_ended",
    FleetDrainStarted(JournalFleetDrain) = "fleet_drain_started",
    FleetDrainEnded(JournalEmpty) = "fleet_drain_ended",
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn t(s: &str) -> Text<'_> {
        Cow::Borrowed(s)
    }

    /// One value of every kind.
    fn samples() -> Vec<Journal<'static>> {
        let token = |by: Option<&'static str>, harness: Option<&'static str>| JournalBudgetToken {
            by: by.map(t),
            harness: harness.map(t),
            operation_id: t("op"),
            owner: t("o"),
            scope: t("s"),
        };
        let eviction = JournalThreadEviction {
            key: t("k"),
            reason: t("operator"),
        };
        let keys = vec![JournalKey {
            key: t("db"),
            mode: t("exclusive"),
        }];
        let reason = Some(JournalReason {
            code: t("slots"),
            message: t("8 of 8"),
        });
        vec![
            Journal::Queued(JournalQueued {
                position: 3,
                reason,
            }),
            Journal::Granted(JournalGranted {
                expires_at: t("2026-12-01T00:00:00.000Z"),
                fence: 7,
                keys,
            }),
            Journal::Renewed(JournalRenewed {
                expires_at: t("2026-12-01T00:00:09.000Z"),
            }),
            Journal::WaitExtended(JournalWaitExtended {
                deadline: t("2026-12-01T00:01:00.000Z"),
            }),
            Journal::Released(JournalFence { fence: Some(7) }),
            Journal::Expired(JournalFence { fence: None }),
            Journal::StopStarted(JournalPids { pids: vec![4, 5] }),
            Journal::Survivors(JournalPids { pids: vec![5] }),
            Journal::Degraded(JournalDegraded {
                survivors: Some(vec![5]),
            }),
            Journal::OomKilled(JournalOom {
                memory_claim_bytes: 64,
                memory_peak_bytes: Some(80),
                oom_kills: 1,
            }),
            Journal::Ended(JournalEnded {
                failure: Some(t("x")),
                state: t("released"),
            }),
            Journal::Promoted(JournalPromoted {
                commit: Some(t("c")),
                fingerprint: t("f"),
                ports: vec!["web".into()],
            }),
            Journal::EvidenceInvalidated(JournalEmpty {}),
            Journal::KeyModeChanged(JournalKey {
                key: t("k"),
                mode: t("shared"),
            }),
            Journal::UpgradeQueued(JournalKeyName { key: t("k") }),
            Journal::UpgradeGranted(JournalKeyName { key: t("k") }),
            Journal::Refused(JournalRefused {
                code: t("stale_fence"),
                message: t("m"),
            }),
            Journal::ProcessRegistered(JournalPid { pid: 42 }),
            Journal::Reaped(JournalReaped {
                state: Some(t("degraded")),
            }),
            Journal::TokenCreated(JournalToken {
                id: t("0123"),
                scope: t("operator"),
                uid: Some(1000),
            }),
            Journal::TokenRevoked(JournalToken {
                id: t("0123"),
                scope: t("operator"),
                uid: None,
            }),
            Journal::ScopeReconciled(JournalScopeReconciled {
                by: t("uid 0"),
                freed: 2,
                owner: t("o"),
                reason: t("r"),
                scope: t("s"),
            }),
            Journal::ScopeForgotten(JournalScopeForgotten {
                by: t("idle"),
                scope: t("s"),
            }),
            Journal::BudgetTokenTaken(token(None, Some("claude"))),
            Journal::BudgetTokenFreed(token(Some("owner"), Some("claude"))),
            Journal::BudgetTokenLapsed(token(None, None)),
            Journal::ScopeFrozen(JournalScopeFrozen {
                manifest: Some(JournalManifest {
                    path: "m".into(),
                    sha256: "0".repeat(64),
                    execution_ids: vec!["e".into()],
                }),
                policy: [("claude".to_string(), 2)].into(),
                scope: t("s"),
            }),
            Journal::ScopeControl(JournalScopeControl {
                control: t("paused"),
                generation: 1,
                mode: t("pause"),
                request_id: t("q"),
                scope: t("s"),
            }),
            Journal::ThreadAttached(JournalThreadAttached {
                key: t("k"),
                owner_fence: 1,
                owner_gen: t("g"),
                run_budget_ms: 60_000,
                run_id: t("r"),
            }),
            Journal::ThreadDeadline(JournalThreadDeadline {
                deadline: t("2026-12-01T00:01:00.000Z"),
                key: t("k"),
                run_id: t("r"),
            }),
            Journal::ThreadDetached(JournalThreadDetached {
                evict: true,
                key: t("k"),
                run_id: t("r"),
            }),
            Journal::ThreadEvicted(eviction.clone()),
            Journal::ThreadEvictRefused(eviction),
            Journal::ThreadWorkspaceCreated(JournalThreadWorkspace {
                key: t("k"),
                workspace: t("/w"),
            }),
            Journal::DrainStarted(JournalDrain {
                by: "uid 0".into(),
                at: "2026-12-01T00:00:00.000Z".into(),
                reason: "r".into(),
            }),
            Journal::DrainEnded(JournalEmpty {}),
            Journal::FleetDrainStarted(JournalFleetDrain {
                at: "2026-12-01T00:00:00.000Z".into(),
                by: "uid 0".into(),
                host: "build-1".into(),
                reason: "r".into(),
            }),
            Journal::FleetDrainEnded(JournalEmpty {}),
        ]
    }

    /// Every kind (the test fails when a new one has no sample) is written as a line
    /// that reads back as a `JournalEntry` whose typed `data` is the value written.
    #[test]
    fn every_kind_reads_back_as_the_value_it_was_written_from() {
        let samples = samples();
        let kinds: BTreeSet<&str> = samples.iter().map(Journal::kind).collect();
        let all: BTreeSet<&str> = Journal::KINDS.iter().map(|(k, _)| *k).collect();
        assert_eq!(kinds, all, "a sample of every kind");
        assert_eq!(all.len(), Journal::KINDS.len(), "each kind once");
        for j in &samples {
            let line = serde_json::to_string(&JournalLine {
                seq: 9,
                at: "now",
                kind: j.kind(),
                run_id: Some("r"),
                project: None,
                data: j,
            })
            .unwrap();
            let back: JournalEntry = serde_json::from_str(&line).unwrap();
            assert_eq!(back.kind, j.kind());
            assert!(back.data.is_object(), "{line}");
            assert_eq!(&back.typed().unwrap().unwrap(), j, "{line}");
            assert_eq!(line, serde_json::to_string(&back).unwrap(), "same bytes");
        }
        let unknown = JournalEntry {
            kind: "from_the_future".into(),
            ..back_of(&samples[0])
        };
        assert!(unknown.typed().is_none());
        let wrong = JournalEntry {
            kind: "granted".into(),
            ..back_of(&samples[0])
        };
        assert!(
            wrong.typed().unwrap().is_err(),
            "queued data is not a grant"
        );
    }

    fn back_of(j: &Journal) -> JournalEntry {
        JournalEntry {
            seq: 1,
            at: "now".into(),
            kind: j.kind().into(),
            run_id: None,
            project: None,
            data: serde_json::to_value(j).unwrap(),
        }
    }

    /// The frequent kinds keep the bytes they had when `data` was a JSON map (keys in
    /// order), so ledgers written before and after read the same.
    #[test]
    fn the_lifecycle_kinds_keep_the_bytes_a_map_gave() {
        let s = samples();
        let want = [
            r#"{"position":3,"reason":{"code":"slots","message":"8 of 8"}}"#,
            r#"{"expires_at":"2026-12-01T00:00:00.000Z","fence":7,"keys":[{"key":"db","mode":"exclusive"}]}"#,
            r#"{"expires_at":"2026-12-01T00:00:09.000Z"}"#,
        ];
        for (j, want) in s.iter().zip(want) {
            let map: Value = serde_json::from_str(want).unwrap();
            assert_eq!(serde_json::to_string(j).unwrap(), want);
            assert_eq!(serde_json::to_string(&map).unwrap(), want);
        }
    }
}
