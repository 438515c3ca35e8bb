//! Plain data that goes in and out of the engine. No behaviour beyond formatting.

use std::collections::BTreeMap;
use std::fmt;

use crate::scopes::{Control, Mode};

/// One codec for the enums berth writes as words (the API, the ledger, the CLI):
/// `as_str`, `ALL` and `FromStr` from one table, so no layer spells them its own way.
macro_rules! words {
    ($ty:ident { $($variant:ident => $word:literal),+ $(,)? }) => {
        impl $ty {
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];
            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $word),+
                }
            }
        }
        impl std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<$ty, String> {
                match s {
                    $($word => Ok($ty::$variant),)+
                    _ => Err(format!(
                        concat!("{:?} is not a ", stringify!($ty), " (one of {})"),
                        s,
                        [$($word),+].join(", ")
                    )),
                }
            }
        }
        /// On the wire, the same word (the API's one codec for it).
        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }
        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<$ty, D::Error> {
                const WORDS: &[&str] = &[$($word),+];
                let s = String::deserialize(d)?;
                s.parse()
                    .map_err(|_| <D::Error as serde::de::Error>::unknown_variant(&s, WORDS))
            }
        }
    };
}

words!(Priority { Foreground => "foreground", Background => "background" });
words!(Class { Managed => "managed", Analysis => "analysis" });
words!(KeyMode { Exclusive => "exclusive", Shared => "shared" });
words!(Concurrency { Serial => "serial", Parallel => "parallel", Disabled => "disabled" });
words!(EndCause { Released => "released", Expired => "expired" });
words!(ConcurrencyClass {
    Serial => "serial",
    ParallelCandidate => "parallel_candidate",
    ParallelSafe => "parallel_safe",
});
words!(Mode { Pause => "pause", Stop => "stop", Resume => "resume" });
words!(Control { Open => "open", Paused => "paused", Stopped => "stopped" });
words!(RunState {
    Queued => "queued",
    Granted => "granted",
    Releasing => "releasing",
    Released => "released",
    Expired => "expired",
    Cancelled => "cancelled",
    Rejected => "rejected",
    Degraded => "degraded",
});

pub use crate::units::{Fence, TimeMs};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Priority {
    Foreground,
    Background,
}

impl Priority {
    pub(crate) fn index(self) -> usize {
        match self {
            Priority::Foreground => 0,
            Priority::Background => 1,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Class {
    /// May start the project's app: ports, databases, browsers.
    Managed,
    /// Reads and thinks; must not open network listeners (C6).
    Analysis,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KeyMode {
    Exclusive,
    Shared,
}

/// What a worktree's `.berth.toml` asks for (C1). Parsing the file is the server's job;
/// the engine only needs the parts that shape the claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Concurrency {
    Serial,
    Parallel,
    Disabled,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ContractInfo {
    pub concurrency: Concurrency,
    /// SHA-256 of the contract's canonical form, hex.
    pub fingerprint: String,
    /// The worktree's commit, if it is a git checkout.
    pub commit: Option<String>,
}

/// A resource request or a capacity vector. Sizes in bytes, cpu in millis.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Resources {
    pub slots: u64,
    pub memory: u64,
    pub cpu_millis: u64,
    pub disk: u64,
    /// Named counted resources (A13), e.g. `gpu`, `browser`, `license.ansys`.
    pub named: BTreeMap<String, u64>,
}

/// Everything a run asks for, exactly as the client sent it (after defaults).
/// Kept whole so an idempotent re-acquire (L7) can be compared with the original.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Request {
    pub run_id: String,
    pub project: String,
    pub class: Class,
    pub priority: Priority,
    pub resources: Resources,
    pub singletons: Vec<String>,
    pub contract: Option<ContractInfo>,
    pub ttl_ms: u64,
    pub wait_ms: u64,
    /// B1/B2: the experiment budget whose token is part of the claim (boxed: most
    /// runs have none, and a `Request` is kept for every run berth remembers).
    pub budget: Option<Box<crate::scopes::Budget>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RunState {
    Queued,
    Granted,
    /// Processes are being stopped; the claim is still held (L5).
    Releasing,
    Released,
    Expired,
    Cancelled,
    Rejected,
    /// Cleanup failed; capacity stays counted until the reaper succeeds (L3).
    Degraded,
}

impl RunState {
    /// D3: a terminal state is never left.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunState::Released | RunState::Expired | RunState::Cancelled | RunState::Rejected
        )
    }
    /// States in which the run's claim is counted against the host.
    pub fn holds_claim(self) -> bool {
        matches!(
            self,
            RunState::Granted | RunState::Releasing | RunState::Degraded
        )
    }
}

/// Why a lease is being stopped; decides the terminal state it ends in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EndCause {
    Released,
    Expired,
}

impl EndCause {
    pub(crate) fn terminal_state(self) -> RunState {
        match self {
            EndCause::Released => RunState::Released,
            EndCause::Expired => RunState::Expired,
        }
    }
}

/// A waiter's reason (A11): a stable code and a human sentence.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Reason {
    pub code: String,
    pub message: String,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} \"{}\"", self.code, self.message)
    }
}

/// Durable promotion evidence (C3).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Evidence {
    pub fingerprint: String,
    pub commit: Option<String>,
    pub ports: Vec<String>,
    pub at_ms: TimeMs,
    pub run_id: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConcurrencyClass {
    Serial,
    ParallelCandidate,
    ParallelSafe,
}

impl ConcurrencyClass {}

/// What the caller learns about one run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunView {
    pub run_id: String,
    pub project: String,
    pub class: Class,
    pub priority: Priority,
    pub state: RunState,
    pub fence: Option<Fence>,
    pub expires_at_ms: Option<TimeMs>,
    /// A lease's ttl: each renew moves its expiry to then + this (a lease only).
    pub ttl_ms: Option<u64>,
    /// Why a run being stopped (releasing, degraded) or stopped is ending.
    pub cause: Option<EndCause>,
    pub deadline_ms: Option<TimeMs>,
    /// 1-based position in the host queue while queued (A11).
    pub position: Option<u64>,
    pub reason: Option<Reason>,
    pub keys: Vec<(String, KeyMode)>,
    pub resources: Resources,
}

/// Formats a byte count the way people read it: `2 GiB`, `1.3 GiB`, `512 MiB`.
pub fn fmt_bytes(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    let (value, unit) = if b >= KIB * KIB * KIB {
        (b / (KIB * KIB * KIB), "GiB")
    } else if b >= KIB * KIB {
        (b / (KIB * KIB), "MiB")
    } else if b >= KIB {
        (b / KIB, "KiB")
    } else {
        return format!("{bytes} B");
    };
    let text = format!("{value:.1}");
    let text = text.strip_suffix(".0").unwrap_or(&text);
    format!("{text} {unit}")
}

/// Formats hundredths of a percent the way PSI writes them: `12.50%`.
pub fn fmt_bp(bp: u32) -> String {
    format!("{}.{:02}%", bp / 100, bp % 100)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hundredths_of_a_percent_read_as_psi_writes_them() {
        assert_eq!(fmt_bp(0), "0.00%");
        assert_eq!(fmt_bp(1_250), "12.50%");
        assert_eq!(fmt_bp(10_000), "100.00%");
    }

    #[test]
    fn bytes_are_formatted_for_people() {
        assert_eq!(fmt_bytes(2 << 30), "2 GiB");
        assert_eq!(fmt_bytes((13 << 30) / 10), "1.3 GiB");
        assert_eq!(fmt_bytes(512 << 20), "512 MiB");
        assert_eq!(fmt_bytes(17), "17 B");
    }
}

#[cfg(test)]
mod word_tests {
    use super::*;

    fn round_trips<T>(all: &[T])
    where
        T: Copy + PartialEq + fmt::Debug + std::str::FromStr<Err = String>,
        T: WordOf,
    {
        let mut seen = std::collections::BTreeSet::new();
        for &v in all {
            assert_eq!(v.word().parse::<T>(), Ok(v), "{v:?}");
            assert!(seen.insert(v.word()), "{v:?}: its word is taken");
        }
        let e = "Nope".parse::<T>().unwrap_err();
        assert!(e.contains(all[0].word()), "{e}");
    }

    trait WordOf {
        fn word(self) -> &'static str;
    }
    macro_rules! word_of {
        ($($ty:ident),+) => {$(impl WordOf for $ty { fn word(self) -> &'static str { self.as_str() } })+};
    }
    word_of!(
        Mode,
        Control,
        Priority,
        Class,
        KeyMode,
        Concurrency,
        EndCause,
        ConcurrencyClass,
        RunState
    );

    /// Every word parses back to its variant, no two variants share one, and anything
    /// else is refused naming the words there are.
    #[test]
    fn every_word_round_trips_and_nothing_else_parses() {
        round_trips(Priority::ALL);
        round_trips(Class::ALL);
        round_trips(KeyMode::ALL);
        round_trips(Concurrency::ALL);
        round_trips(EndCause::ALL);
        round_trips(ConcurrencyClass::ALL);
        round_trips(RunState::ALL);
        round_trips(Mode::ALL);
        round_trips(Control::ALL);
        assert_eq!(RunState::ALL.len(), 8);
    }
}
