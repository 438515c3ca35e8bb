//! B1–B6: experiment budgets, the daemon's side. The rules are the engine's (a run's
//! token is part of its claim; `berth_core::scopes` keeps the policy, the tokens and
//! the control state); this turns each budget event into its ledger row and its
//! journal entry, in the transaction of the step that made it (D1, D5), and answers
//! the scope routes once they are durable.

use std::collections::{BTreeMap, BTreeSet};

use berth_client::wire;
use berth_core::scopes::{Scope, ScopeError, Token};
use berth_core::{Command, Error as CoreError, Event};
use berth_store::{Mutation, ScopeRecord};

use super::{Daemon, Error, Host, Reply, Tenant};

/// The waiters `GET /v1/scopes/{id}` lists at most (it counts them all).
pub const SCOPE_WAITERS_SHOWN: usize = 100;
/// The tokens (and lapsed owners) it lists at most: a scope may hold 65,536, a
/// megabytes-long answer (it counts them all).
pub const SCOPE_TOKENS_SHOWN: usize = 1_000;

/// What a scope message asks: show a scope, apply one of the engine's budget commands
/// (`Reserve`, `Unreserve`, `ScopeControl`), or reconcile (the engine's `Reconcile` and
/// the journal's record of who asked and why).
pub enum ScopeOp {
    Get {
        scope: String,
    },
    Apply(Command),
    /// A command only the scope's own user (or an unbound token) may send (S9):
    /// `ScopeControl` and `DeleteScope`.
    Owned {
        cmd: Command,
        by: Tenant,
    },
    Reconcile {
        scope: String,
        owner: String,
        reason: String,
        by: String,
    },
    /// S9 in fleet mode, before the fleet store decides a control: may `by` control
    /// the scope? Only a token without a uid (an unbound operator token, the admin
    /// token) may: no host knows who made the scope on the others.
    MayControl {
        scope: String,
        by: Tenant,
    },
}

/// The answer to each [`ScopeOp`], in its own wire type.
#[derive(Debug)]
pub enum ScopeAnswer {
    Scope(wire::Scope),
    Reservation(wire::Reservation),
    Token(wire::ScopeToken),
    Reconciled(wire::Reconciled),
    Receipt(wire::ControlReceipt),
    /// S10: the scope as it was when an operator deleted it.
    Deleted(wire::ScopeSummary),
    /// `MayControl`: yes.
    Allowed,
}

fn not_found(scope: &str) -> Error {
    Error::Core(CoreError::from(ScopeError::NotFound {
        what: format!("scope {scope}"),
    }))
}

fn harnesses(s: &Scope) -> BTreeMap<String, wire::HarnessFigures> {
    let mut lapsed: BTreeMap<&str, u32> = BTreeMap::new();
    for t in s.tokens.values().filter(|t| t.owner_lapsed) {
        *lapsed.entry(&t.harness).or_default() += 1;
    }
    s.policy
        .iter()
        .map(|(h, &limit)| {
            let held = s.holders(h) as u32;
            let lapsed = lapsed.get(h.as_str()).copied().unwrap_or(0);
            (
                h.clone(),
                wire::HarnessFigures {
                    limit,
                    held,
                    lapsed,
                },
            )
        })
        .collect()
}

fn summary(s: &Scope) -> wire::ScopeSummary {
    wire::ScopeSummary {
        scope: s.id.clone(),
        control: s.control.as_str().into(),
        generation: s.generation,
        harnesses: harnesses(s),
        lapsed: s.tokens.values().filter(|t| t.owner_lapsed).count() as u64,
    }
}

/// How a scope command's answer is read from the daemon once the command is applied.
type Answer<D> = Box<dyn FnOnce(&D) -> Option<ScopeAnswer>>;

impl<H: Host> Daemon<H> {
    pub(super) fn on_scope(&mut self, op: ScopeOp, reply: Reply<ScopeAnswer>) {
        let cmd = match op {
            ScopeOp::Get { scope } => {
                let v = self.scope_view(&scope).map(ScopeAnswer::Scope);
                return self.answer(reply, v.ok_or_else(|| not_found(&scope)));
            }
            ScopeOp::Reconcile {
                scope,
                owner,
                reason,
                by,
            } => return self.reconcile(scope, owner, reason, by, reply),
            // S9 fleet-wide: a control acts on every host, and each host knows only
            // whose runs made the scope there. Another user's runs may have made it on
            // another host first (a scope is named by its runs), so a uid-bound token's
            // user is never known to own it fleet-wide: refused. (Before, a user whose run had used another
            // user's scope name on a host of its own paused or stopped that scope on
            // every host.)
            ScopeOp::MayControl { scope, by } => {
                let v = match by {
                    None => Ok(ScopeAnswer::Allowed),
                    Some(uid) => Err(self.not_owner(crate::error::FLEET_SCOPE, scope, uid)),
                };
                return self.commit_and_answer(BTreeSet::new(), reply, v);
            }
            ScopeOp::Apply(cmd) => cmd,
            ScopeOp::Owned { cmd, by } => match self.check_scope_owner(&cmd, by) {
                Ok(()) => cmd,
                Err(e) => return self.commit_and_answer(BTreeSet::new(), reply, Err(e)),
            },
        };
        let Some(answer) = self.scope_answer(&cmd) else {
            let e = Error::Internal("not a budget command".into());
            return self.answer(reply, Err(e));
        };
        let (touched, done) = self.scope_step(cmd);
        let v = done.and_then(|()| {
            answer(self).ok_or_else(|| Error::Internal("the scope's answer vanished".into()))
        });
        self.commit_and_answer(touched, reply, v);
    }

    /// How a budget command's answer is read once it is applied (what it reads from
    /// before, such as a token about to be freed, is taken now); `None`: not a budget
    /// command.
    fn scope_answer(&self, cmd: &Command) -> Option<Answer<Self>> {
        Some(match cmd {
            Command::Reserve {
                scope,
                owner,
                operation_id,
                ..
            } => {
                let new = self
                    .engine
                    .scopes()
                    .token(scope, owner, operation_id)
                    .is_none();
                let (scope, owner, operation_id) =
                    (scope.clone(), owner.clone(), operation_id.clone());
                Box::new(move |d: &Self| {
                    let token = d.token_out(&scope, &owner, &operation_id)?;
                    let r = wire::Reservation { scope, token, new };
                    Some(ScopeAnswer::Reservation(r))
                })
            }
            Command::Unreserve {
                scope,
                owner,
                operation_id,
            } => {
                // The token as it was: once freed, it is gone.
                let before = self.token_out(scope, owner, operation_id);
                Box::new(move |_: &Self| before.map(ScopeAnswer::Token))
            }
            Command::ScopeControl {
                scope, request_id, ..
            } => {
                let (scope, request_id) = (scope.clone(), request_id.clone());
                Box::new(move |d: &Self| {
                    let r = d.receipt_out(&scope, &request_id)?;
                    Some(ScopeAnswer::Receipt(r))
                })
            }
            Command::DeleteScope { scope } => {
                let before = self.engine.scopes().get(scope).map(summary);
                Box::new(move |_: &Self| before.map(ScopeAnswer::Deleted))
            }
            // Not a budget command: refused, nothing applied.
            _ => return None,
        })
    }

    /// S9: a uid-bound token controls or deletes only scopes its user's runs froze.
    /// Refused (and journaled) before the engine sees the command.
    fn check_scope_owner(&mut self, cmd: &Command, by: Tenant) -> Result<(), Error> {
        let (Command::ScopeControl { scope, .. } | Command::DeleteScope { scope }) = cmd else {
            return Ok(());
        };
        match (self.engine.scopes().get(scope), by) {
            (Some(s), Some(uid)) if !super::may_act(by, s.owner_uid) => {
                Err(self.not_owner("scope", scope.clone(), uid))
            }
            _ => Ok(()),
        }
    }

    /// B3: an operator frees `owner`'s tokens (all or none), journaled with its reason.
    fn reconcile(
        &mut self,
        scope: String,
        owner: String,
        reason: String,
        by: String,
        reply: Reply<ScopeAnswer>,
    ) {
        let held = self.engine.scopes().owner_operations(&scope, &owner);
        let freed: Vec<wire::ScopeToken> = held
            .iter()
            .map(|(op, t)| self.wire_token(&owner, op, t))
            .collect();
        let cmd = Command::Reconcile {
            scope: scope.clone(),
            owner: owner.clone(),
        };
        let (touched, done) = self.scope_step(cmd);
        let v = done.map(|()| {
            let data = wire::JournalScopeReconciled {
                by: by.into(),
                freed: freed.len() as u64,
                owner: owner.as_str().into(),
                reason: reason.as_str().into(),
                scope: scope.as_str().into(),
            };
            self.journal_entry(None, None, wire::Journal::ScopeReconciled(data));
            let r = wire::Reconciled {
                scope,
                owner,
                reason,
                freed,
            };
            ScopeAnswer::Reconciled(r)
        });
        self.commit_and_answer(touched, reply, v);
    }

    /// One budget command through the engine. The runs it touched are committed with
    /// its answer, refused or not: a freed token can let a waiter in, and the time the
    /// command brought may have ended leases even when the command itself is refused.
    fn scope_step(&mut self, cmd: Command) -> (BTreeSet<String>, Result<(), Error>) {
        let mut touched = BTreeSet::new();
        let done = self
            .apply(cmd, &mut touched)
            .map(|_| ())
            .map_err(Error::from);
        (touched, done)
    }

    pub(super) fn on_scope_list(&mut self, reply: Reply<Vec<wire::ScopeSummary>>) {
        let list = self.engine.scopes().iter().map(summary).collect();
        self.answer(reply, Ok(list));
    }

    /// A waiter refused because its scope stopped (B4) is told why.
    pub(super) fn scope_rejected(&mut self, run_id: &str) {
        let scope = self.engine.budget_of(run_id).map(|b| b.scope.clone());
        if let (Some(e), Some(scope)) = (self.extras.get_mut(run_id), scope) {
            e.failure = Some(format!(
                "scope {scope} was stopped: its waiters are refused (B4)"
            ));
        }
    }

    /// B1–B5: a budget event's ledger row and journal entry, in this step's commit.
    pub(super) fn on_scope_event(&mut self, ev: &Event) {
        match ev {
            Event::ScopeFrozen { scope } => self.on_scope_frozen(scope),
            Event::ScopeForgotten { scope, by_operator } => {
                self.pending_mutations
                    .push(Mutation::ScopeDeleted(scope.clone()));
                let by = if *by_operator { "operator" } else { "idle" };
                let data = wire::JournalScopeForgotten {
                    by: by.into(),
                    scope: scope.into(),
                };
                self.journal_entry(None, None, wire::Journal::ScopeForgotten(data));
            }
            Event::TokenTaken {
                scope,
                owner,
                operation,
                harness,
                run_id,
            } => {
                self.push_token(scope, owner, operation);
                let data = budget_token(scope, owner, operation, Some(harness), None);
                let data = wire::Journal::BudgetTokenTaken(data);
                match run_id {
                    Some(r) => self.journal(r, data),
                    None => self.journal_entry(None, None, data),
                }
            }
            Event::TokenFreed {
                scope,
                owner,
                operation,
                harness,
                reconciled,
            } => {
                self.push_token(scope, owner, operation);
                let by = if *reconciled { "operator" } else { "owner" };
                let data = budget_token(scope, owner, operation, Some(harness), Some(by));
                self.journal_entry(None, None, wire::Journal::BudgetTokenFreed(data));
            }
            Event::TokenLapsed {
                scope,
                owner,
                operation,
            } => {
                self.push_token(scope, owner, operation);
                let data = budget_token(scope, owner, operation, None, None);
                self.journal_entry(None, None, wire::Journal::BudgetTokenLapsed(data));
            }
            Event::ScopeControlled { scope, receipt } => self.on_scope_controlled(scope, receipt),
            _ => {}
        }
    }

    /// B1: the scope's policy froze; its story starts with this entry (retention keeps
    /// it from here).
    fn on_scope_frozen(&mut self, scope: &str) {
        let Some(s) = self.engine.scopes().get(scope) else {
            return;
        };
        let data = wire::JournalScopeFrozen {
            manifest: s.manifest.as_ref().map(|m| wire::JournalManifest {
                execution_ids: m.execution_ids.clone(),
                path: m.path.clone(),
                sha256: m.sha256.clone(),
            }),
            policy: s.policy.clone(),
            scope: scope.to_string().into(),
        };
        let first = self.journal_next;
        self.push_scope(scope, first);
        self.journal_entry(None, None, wire::Journal::ScopeFrozen(data));
    }

    /// B4: an accepted control request: the scope's row, its receipt, the entry.
    fn on_scope_controlled(&mut self, scope: &str, receipt: &berth_core::scopes::Receipt) {
        self.push_scope(scope, 0);
        self.pending_mutations.push(Mutation::ScopeReceipt {
            scope: scope.to_string(),
            receipt: receipt.clone(),
        });
        let data = wire::JournalScopeControl {
            control: receipt.control.as_str().into(),
            generation: receipt.generation,
            mode: receipt.mode.as_str().into(),
            request_id: receipt.request_id.as_str().into(),
            scope: scope.into(),
        };
        self.journal_entry(None, None, wire::Journal::ScopeControl(data));
    }

    /// The scope's row; `journal_first` is its first journal entry when known (0: the
    /// one written before is kept).
    fn push_scope(&mut self, scope: &str, journal_first: u64) {
        if let Some(s) = self.engine.scopes().get(scope) {
            let rec = ScopeRecord {
                id: s.id.clone(),
                policy: s.policy.clone(),
                manifest: s.manifest.clone(),
                control: s.control,
                generation: s.generation,
                owner_uid: s.owner_uid,
                journal_first,
            };
            self.pending_mutations.push(Mutation::Scope(rec));
        }
    }

    /// The token as the engine holds it after this step (or its absence): the rows of
    /// one step are written in order, so the last one is what the step left.
    fn push_token(&mut self, scope: &str, owner: &str, operation: &str) {
        let token = self.engine.scopes().token(scope, owner, operation).cloned();
        self.pending_mutations.push(Mutation::BudgetToken {
            scope: scope.to_string(),
            owner: owner.to_string(),
            operation: operation.to_string(),
            token,
        });
    }

    fn wire_token(&self, owner: &str, operation: &str, t: &Token) -> wire::ScopeToken {
        wire::ScopeToken {
            owner: owner.to_string(),
            operation_id: operation.to_string(),
            harness: t.harness.clone(),
            run_id: t.run_id.clone(),
            since: self.host.show_time(t.since_ms),
            owner_lapsed: t.owner_lapsed,
        }
    }

    fn token_out(&self, scope: &str, owner: &str, operation: &str) -> Option<wire::ScopeToken> {
        let t = self.engine.scopes().token(scope, owner, operation)?;
        Some(self.wire_token(owner, operation, t))
    }

    fn receipt_out(&self, scope: &str, request_id: &str) -> Option<wire::ControlReceipt> {
        let s = self.engine.scopes().get(scope)?;
        let r = s.receipts.iter().find(|r| r.request_id == request_id)?;
        Some(self.wire_receipt(scope, r))
    }

    fn wire_receipt(&self, scope: &str, r: &berth_core::scopes::Receipt) -> wire::ControlReceipt {
        wire::ControlReceipt {
            scope: scope.to_string(),
            request_id: r.request_id.clone(),
            mode: r.mode.as_str().into(),
            generation: r.generation,
            control: r.control.as_str().into(),
            at: self.host.show_time(r.at_ms),
        }
    }

    /// B6: everything about one scope.
    fn scope_view(&self, scope: &str) -> Option<wire::Scope> {
        let s = self.engine.scopes().get(scope)?;
        let tokens: Vec<wire::ScopeToken> = s
            .tokens
            .iter()
            .take(SCOPE_TOKENS_SHOWN)
            .map(|((o, op), t)| self.wire_token(o, op, t))
            .collect();
        let lapsed: BTreeSet<String> = s
            .tokens
            .iter()
            .filter(|(_, t)| t.owner_lapsed)
            .map(|((o, _), _)| o.clone())
            .take(SCOPE_TOKENS_SHOWN)
            .collect();
        let (views, waiting) = self.engine.scope_waiters(scope, SCOPE_WAITERS_SHOWN);
        let waiters = views
            .into_iter()
            .map(|v| wire::ScopeWaiter {
                harness: self
                    .engine
                    .budget_of(&v.run_id)
                    .map(|b| b.harness.clone())
                    .unwrap_or_default(),
                run_id: v.run_id,
                position: v.position.unwrap_or(0),
                reason: v.reason.map(|r| wire::Reason {
                    code: r.code,
                    message: r.message,
                }),
            })
            .collect();
        Some(wire::Scope {
            scope: scope.to_string(),
            harnesses: harnesses(s),
            manifest: s.manifest.as_ref().map(|m| wire::ScopeManifest {
                path: m.path.clone(),
                sha256: m.sha256.clone(),
                execution_ids: m.execution_ids.clone(),
            }),
            control: s.control.as_str().into(),
            generation: s.generation,
            tokens,
            tokens_held: s.tokens.len() as u64,
            lapsed_owners: lapsed.into_iter().collect(),
            receipts: s
                .receipts
                .iter()
                .map(|r| self.wire_receipt(scope, r))
                .collect(),
            waiters,
            waiting: waiting as u64,
        })
    }
}

/// One budget token as the journal says it.
fn budget_token<'a>(
    scope: &'a str,
    owner: &'a str,
    operation: &'a str,
    harness: Option<&'a str>,
    by: Option<&'a str>,
) -> wire::JournalBudgetToken<'a> {
    wire::JournalBudgetToken {
        by: by.map(Into::into),
        harness: harness.map(Into::into),
        operation_id: operation.into(),
        owner: owner.into(),
        scope: scope.into(),
    }
}
