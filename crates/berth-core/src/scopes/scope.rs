//! One scope: its frozen policy and manifest, its control state and generation, its
//! receipts and the tokens it holds.

use super::*;

/// B4: what a control request asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mode {
    Pause,
    Stop,
    Resume,
}

// Mode's and Control's words (`as_str`, `FromStr`, serde) are `types.rs`' one codec.

/// B4/B5: a scope's control state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Open,
    Paused,
    /// Terminal: the scope never admits again.
    Stopped,
}

/// B4: the answer to an accepted control request (the same again for its retries).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Receipt {
    pub request_id: String,
    pub mode: Mode,
    /// The scope's generation this request made.
    pub generation: u64,
    /// The state it left the scope in.
    pub control: Control,
    pub at_ms: TimeMs,
}

/// One reserved token (B2): its harness, the run that holds it (if a run's claim took
/// it), since when, and whether its owner's lease lapsed (B3: it stays held).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Token {
    pub harness: String,
    pub run_id: Option<String>,
    pub since_ms: TimeMs,
    pub owner_lapsed: bool,
}

/// One scope.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    pub id: String,
    pub policy: Policy,
    pub manifest: Option<Manifest>,
    pub control: Control,
    /// Bumped by exactly one per accepted control request (B4).
    pub generation: u64,
    /// Accepted control requests, oldest first, at most `RECEIPTS_MAX`.
    pub receipts: Vec<Receipt>,
    /// Tokens held, by (owner, operation id).
    pub tokens: BTreeMap<(String, String), Token>,
    /// Tokens held per harness: derived from `tokens` (recounted by
    /// [`Scopes::restore`], checked by `check_invariants`), so an admission pass asks
    /// for a count without walking the tokens.
    pub held: BTreeMap<String, u32>,
    /// S9: the uid of the uid-bound token whose run froze the scope (`None`: an
    /// unbound token's). Only that user's tokens (or unbound ones) may control,
    /// reconcile or delete it.
    pub owner_uid: Option<u32>,
    /// Runs not yet ended whose claim names this scope (derived: the engine counts
    /// them as runs come and end, and recounts them on restore).
    pub users: u32,
    /// When a run or a token last came to or left the scope (not kept in the ledger: a
    /// restart starts the idle window again, which only ever keeps a scope longer).
    pub touched_ms: TimeMs,
}

impl Scope {
    /// A scope frozen now with this policy and manifest: open, generation 0.
    pub fn new(id: &str, policy: Policy, manifest: Option<Manifest>) -> Scope {
        Scope {
            id: id.into(),
            policy,
            manifest,
            control: Control::Open,
            generation: 0,
            receipts: Vec::new(),
            tokens: BTreeMap::new(),
            held: BTreeMap::new(),
            owner_uid: None,
            users: 0,
            touched_ms: 0,
        }
    }

    /// Nothing holds the scope: no run names it, no token is held, and it was never
    /// paused or stopped (a control state is a promise kept: B4's stop is terminal).
    pub fn is_idle(&self) -> bool {
        self.users == 0
            && self.tokens.is_empty()
            && self.control == Control::Open
            && self.receipts.is_empty()
    }

    /// Tokens held of `harness`.
    pub fn holders(&self, harness: &str) -> usize {
        self.held.get(harness).copied().unwrap_or(0) as usize
    }

    pub(super) fn count(&mut self, harness: &str, up: bool) {
        let n = self.held.entry(harness.to_string()).or_insert(0);
        if up {
            *n += 1;
        } else {
            *n -= 1;
        }
        if *n == 0 {
            self.held.remove(harness);
        }
    }
}
