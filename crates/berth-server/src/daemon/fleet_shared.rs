//! Issue 38 Build 3 in the daemon: what every host of a fleet mirrors. Fleet tokens
//! (kept hashed in the fleet store, honoured by every host) are mirrored into the
//! token table requests are checked against and into the ledger, so a host that
//! restarts while the database is away still knows the tokens its runs renew with. The
//! fleet drain is held beside the host's own: either one refuses new runs and new
//! registrations (G4), and `GET /v1/drain` shows both.
//!
//! Changes reach the daemon two ways: this host's own, answered by the fleet store
//! with the version that has them (`Msg::FleetChanged`, mirrored before the caller is
//! answered), and the fleet threads' reads of the whole set (`Report::Shared`: at
//! registration, at each heartbeat that finds a newer version, and when another host
//! announces one). A read older than a change already mirrored is skipped: the next
//! one is newer.

use std::collections::{BTreeMap, BTreeSet};

use berth_client::wire;
use berth_store::fleet::{FleetDrain, FleetEvidence, FleetReceipt, FleetToken, Shared};
use berth_store::{DrainRecord, Mutation};

use super::{Daemon, Host, Reply};
use crate::auth::{self, Grant};
use crate::fleet::SharedJob;

/// A change this host made to the fleet's tokens or drain (committed in the store).
#[derive(Clone, Debug)]
pub enum FleetChange {
    TokenMade {
        hash: String,
        grant: Grant,
    },
    TokensRevoked {
        hashes: Vec<String>,
    },
    Drain(Option<FleetDrain>),
    /// B4 fleet-wide: a scope control the store accepted.
    Control {
        scope: String,
        receipt: FleetReceipt,
    },
}

fn record_of(d: &FleetDrain) -> DrainRecord {
    DrainRecord {
        by: d.by.clone(),
        at: d.at.clone(),
        reason: d.reason.clone(),
    }
}

impl<H: Host> Daemon<H> {
    /// The fleet threads read what the fleet shares: its tokens, its drain, its scopes'
    /// controls and its projects' evidence.
    pub(super) fn on_fleet_shared(&mut self, sh: Shared) {
        if sh.version < self.fleet.shared_version {
            return;
        }
        self.fleet.shared_version = sh.version;
        let mut want = BTreeMap::new();
        for FleetToken { hash, grant, .. } in &sh.tokens {
            // Only what berth writes: a fleet grant. A row another writer put there
            // (a hostile database user, a newer berth) grants nothing here.
            match Grant::parse(grant).filter(|g| g.fleet) {
                Some(g) => _ = want.insert(hash.clone(), g),
                None => tracing::warn!(
                    id = auth::token_id(hash),
                    "fleet: a fleet token's grant is not one this berth reads; it is not honoured here"
                ),
            }
        }
        self.mirror_tokens(want, None);
        let mut touched = BTreeSet::new();
        self.mirror_drain(sh.drain, &mut touched);
        for c in &sh.controls {
            self.mirror_control(&c.scope, &c.last, &mut touched);
        }
        for e in &sh.evidence {
            self.mirror_evidence(e, &mut touched);
        }
        // Always: a command to the engine brings its time too (a lease that ran out
        // meanwhile ends in this step), and a read comes only when the version moved.
        self.commit(touched, |_| {});
    }

    /// This host changed the fleet's tokens, drain or a scope's control (the store
    /// answered `version`):
    /// mirrored before the caller is answered, so the caller's next request here
    /// finds it.
    pub(super) fn on_fleet_changed(
        &mut self,
        change: FleetChange,
        version: i64,
        reply: Reply<wire::Drain>,
    ) {
        self.fleet.shared_version = self.fleet.shared_version.max(version);
        let mut touched = BTreeSet::new();
        match change {
            FleetChange::TokenMade { hash, grant } => {
                let mut want = self.fleet_tokens();
                want.insert(hash, grant);
                self.mirror_tokens(want, None);
            }
            FleetChange::TokensRevoked { hashes } => {
                let want = self.fleet_tokens();
                self.mirror_tokens(want, Some(&hashes));
            }
            FleetChange::Drain(d) => _ = self.mirror_drain(d, &mut touched),
            FleetChange::Control { scope, receipt } => {
                _ = self.mirror_control(&scope, &receipt, &mut touched)
            }
        }
        let v = Ok(self.drain_out());
        self.commit_and_answer(touched, reply, v);
    }

    fn fleet_tokens(&self) -> BTreeMap<String, Grant> {
        let table = self.shared.tokens.read().unwrap_or_else(|e| e.into_inner());
        (table.iter())
            .filter(|(_, g)| g.fleet)
            .map(|(h, g)| (h.clone(), *g))
            .collect()
    }

    /// Makes the table's fleet tokens `want`, less `revoked`: the ones gone are
    /// refused from now on, the new ones honoured; each change journaled and in the
    /// next commit. Host tokens are never touched. True if anything changed.
    fn mirror_tokens(
        &mut self,
        mut want: BTreeMap<String, Grant>,
        revoked: Option<&[String]>,
    ) -> bool {
        for h in revoked.unwrap_or_default() {
            want.remove(h);
        }
        let (gone, added) = {
            let mut table = self
                .shared
                .tokens
                .write()
                .unwrap_or_else(|e| e.into_inner());
            let mut gone = Vec::new();
            table.retain(|(h, g)| {
                let keep = !g.fleet || want.contains_key(h);
                if !keep {
                    gone.push((h.clone(), *g));
                }
                keep
            });
            let added: Vec<(String, Grant)> = (want.into_iter())
                .filter(|(h, _)| !table.iter().any(|(t, _)| t == h))
                .collect();
            table.extend(added.iter().cloned());
            (gone, added)
        };
        for (hash, g) in &gone {
            let data = super::handlers::journal_token(auth::token_id(hash), g);
            self.journal_entry(None, None, wire::Journal::TokenRevoked(data));
            let hash = hash.clone();
            self.pending_mutations.push(Mutation::TokenRevoked { hash });
        }
        for (hash, g) in &added {
            let data = super::handlers::journal_token(auth::token_id(hash), g);
            self.journal_entry(None, None, wire::Journal::TokenCreated(data));
            let (hash, scope) = (hash.clone(), g.stored());
            self.pending_mutations.push(Mutation::Token { hash, scope });
        }
        !gone.is_empty() || !added.is_empty()
    }

    /// The fleet drain is `d` from now on; the engine drains while either drain is in
    /// force. True if it changed.
    fn mirror_drain(&mut self, d: Option<FleetDrain>, touched: &mut BTreeSet<String>) -> bool {
        if self.th.fleet_drain == d {
            return false;
        }
        let data = match &d {
            Some(d) => wire::Journal::FleetDrainStarted(wire::JournalFleetDrain {
                at: d.at.clone(),
                by: d.by.clone(),
                host: d.host_id.clone(),
                reason: d.reason.clone(),
            }),
            None => wire::Journal::FleetDrainEnded(wire::JournalEmpty {}),
        };
        self.journal_entry(None, None, data);
        self.th.fleet_drain = d;
        self.drain_engine(touched);
        true
    }

    /// B4 fleet-wide: the engine takes the fleet's control of `scope` if it is newer
    /// than the scope's (its waiters then wait with `scope.paused`, or are refused once
    /// it stops). True if it changed anything.
    fn mirror_control(
        &mut self,
        scope: &str,
        r: &FleetReceipt,
        touched: &mut BTreeSet<String>,
    ) -> bool {
        let generation = |d: &Self| d.engine.scopes().get(scope).map(|s| s.generation);
        let before = generation(self);
        let receipt = berth_core::scopes::Receipt {
            request_id: r.request_id.clone(),
            mode: r.mode,
            generation: r.generation,
            control: r.control,
            at_ms: self.now,
        };
        let cmd = berth_core::Command::FleetControl {
            scope: scope.into(),
            receipt,
        };
        let _ = self.apply(cmd, touched);
        generation(self) != before
    }

    /// C3/C4 fleet-wide: evidence proven or found wrong here is told to the fleet once
    /// the step is durable (not evidence the fleet told this host).
    pub(super) fn share_evidence(&mut self, project: &str, e: &berth_core::Evidence, valid: bool) {
        if self.fleet.link.is_none() || self.fleet.mirroring {
            return;
        }
        let job = match valid {
            true => SharedJob::PutEvidence(FleetEvidence {
                project: project.into(),
                fingerprint: e.fingerprint.clone(),
                commit: e.commit.clone(),
                ports: e.ports.clone(),
                run_id: e.run_id.clone(),
                host_id: self.fleet.host_id.clone(),
                valid: true,
            }),
            false => SharedJob::InvalidateEvidence {
                project: project.into(),
                fingerprint: e.fingerprint.clone(),
                commit: e.commit.clone(),
            },
        };
        self.fleet.shared_jobs.push(job);
    }

    /// C3/C4 fleet-wide: the fleet's evidence of `e.project`, taken by the engine (not
    /// told back to the fleet).
    fn mirror_evidence(&mut self, e: &FleetEvidence, touched: &mut BTreeSet<String>) {
        let evidence = berth_core::Evidence {
            fingerprint: e.fingerprint.clone(),
            commit: e.commit.clone(),
            ports: e.ports.clone(),
            at_ms: self.now,
            run_id: e.run_id.clone(),
        };
        let cmd = berth_core::Command::FleetEvidence {
            project: e.project.clone(),
            evidence,
            valid: e.valid,
        };
        self.fleet.mirroring = true;
        let _ = self.apply(cmd, touched);
        self.fleet.mirroring = false;
    }

    /// The engine drains while the host's drain or the fleet's is in force.
    pub(super) fn drain_engine(&mut self, touched: &mut BTreeSet<String>) {
        let on = self.th.drain.is_some() || self.th.fleet_drain.is_some();
        let _ = self.apply(berth_core::Command::Drain { on }, touched);
    }

    /// G4: the refusal of a new run or registration while a drain is in force: the
    /// host's own, or else the fleet's (naming the host it was started on).
    pub(super) fn draining(&self) -> Option<super::Error> {
        match (&self.th.drain, &self.th.fleet_drain) {
            (Some(d), _) => Some(super::Error::Draining {
                drain: d.clone(),
                fleet_host: None,
            }),
            (None, Some(f)) => Some(super::Error::Draining {
                drain: record_of(f),
                fleet_host: Some(f.host_id.clone()),
            }),
            (None, None) => None,
        }
    }
}
