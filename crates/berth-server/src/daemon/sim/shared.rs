//! Issue 38 Build 3 in the daemon simulator: the fleet's tokens and drain change, made
//! by this host (the store first, then `Msg::FleetChanged`, as the API does) or by the
//! peer (the store only: this host learns at its next heartbeat's read), with the link
//! cut at times and the daemon crashing between. Checked after each heartbeat that
//! reached the store: this host's mirror is the store's (its fleet tokens, its fleet
//! drain), and the engine drains while a fleet drain is mirrored. Checked after each
//! change this host made: the mirror has it before the caller is answered.

use std::collections::BTreeMap;

use berth_core::scopes::Mode;
use berth_store::fleet::{
    ControlOutcome, FleetDrain, FleetError, FleetEvidence, FleetStore, FleetToken,
    ScopeControlRequest,
};

use super::fleet::{HOST, PEER};
use super::Sim;
use crate::auth::{Grant, Scope};
use crate::daemon::{FleetChange, Msg};

impl Sim {
    /// One change of the fleet's tokens, drain or a scope's control, by this host or
    /// the peer.
    pub(super) fn shared_turn(&mut self) -> String {
        let by_peer = self.rng.chance(0.5);
        let mut s = self.fleet_store(by_peer);
        let host = if by_peer { PEER } else { HOST };
        let change = match self.rng.range(0, 5) {
            0 => self.token_made(&mut *s, host),
            1 => {
                let known = self.fleet_store(true).shared(-1).ok().flatten();
                let Some(t) = known.and_then(|sh| sh.tokens.first().cloned()) else {
                    return "shared: no fleet token to revoke".into();
                };
                let r = s.revoke_token(&t.hash[..16]);
                r.map(|(gone, v)| {
                    let hashes = gone.into_iter().map(|t| t.hash).collect();
                    (FleetChange::TokensRevoked { hashes }, v)
                })
            }
            2 => {
                let d = self.rng.chance(0.5).then(|| FleetDrain {
                    by: "uid 0 (admin token)".into(),
                    at: format!("t{}", self.now),
                    reason: "sim".into(),
                    host_id: host.into(),
                });
                let r = s.set_drain(d.as_ref());
                r.map(|(now, v)| (FleetChange::Drain(now), v))
            }
            // C3/C4 fleet-wide: the peer proves or refutes a project's evidence (this
            // host's runs have no contract: it never proves one itself).
            4 => return self.peer_evidence(),
            _ => match self.control(&mut *s, host) {
                Ok(Some(c)) => Ok(c),
                Ok(None) => return "shared: a control refused".into(),
                Err(e) => Err(e),
            },
        };
        let (change, version) = match (change, by_peer) {
            (Err(e), _) => return format!("shared: refused {e}"),
            (Ok(c), true) => return format!("shared: the peer changed {c:?}"),
            (Ok(c), false) => c,
        };
        let line = format!("shared: this host changed {change:?} at v{version}");
        // The API's own request, answered once the mirror has it.
        let made = change.clone();
        let res = self.ask(|reply| Msg::FleetChanged {
            change,
            version,
            reply,
        });
        match res {
            Ok(_) => self.check_own_change(made),
            Err(e) => return format!("{line}, answered {e:?}"),
        }
        line
    }

    /// The peer proves or refutes a project's evidence.
    fn peer_evidence(&mut self) -> String {
        let mut p = self.fleet_store(true);
        let project = format!("p{}", self.rng.range(0, 3));
        let fingerprint = format!("f{}", self.rng.range(0, 1));
        let r = match self.rng.chance(0.6) {
            true => p.put_evidence(&FleetEvidence {
                project: project.clone(),
                fingerprint,
                commit: Some("c".into()),
                ports: vec!["web".into()],
                run_id: "peer-prover".into(),
                host_id: PEER.into(),
                valid: true,
            }),
            false => p.invalidate_evidence(&project, &fingerprint, Some("c")),
        };
        format!("shared: the peer's evidence of {project}: {r:?}")
    }

    fn token_made(
        &mut self,
        s: &mut dyn FleetStore,
        host: &str,
    ) -> Result<(FleetChange, i64), FleetError> {
        let n = self.rng.range(0, 1 << 20);
        let grant = Grant {
            scope: Scope::Operator,
            uid: None,
            expires_ms: None,
            fleet: true,
        };
        let hash = crate::auth::hash_token(&format!("fleet-{n}"));
        let row = FleetToken {
            hash: hash.clone(),
            grant: grant.stored(),
            host_id: host.into(),
        };
        let v = s.put_token(&row)?;
        Ok((FleetChange::TokenMade { hash, grant }, v))
    }

    /// B4 fleet-wide: a few request ids, so that retries and conflicts come too; `None`
    /// if the fleet refused it (a conflict, a stopped scope).
    fn control(
        &mut self,
        s: &mut dyn FleetStore,
        host: &str,
    ) -> Result<Option<(FleetChange, i64)>, FleetError> {
        let modes = [Mode::Pause, Mode::Resume, Mode::Stop];
        let r = ScopeControlRequest {
            scope: "sim".into(),
            request_id: format!("q{}", self.rng.range(0, 12)),
            mode: modes[self.rng.range(0, 2) as usize],
        };
        Ok(match s.control_scope(&r, host)? {
            (ControlOutcome::Accepted(receipt), v) => {
                let scope = r.scope;
                Some((FleetChange::Control { scope, receipt }, v))
            }
            _ => None,
        })
    }

    /// A change this host made is in its mirror when the caller is answered.
    fn check_own_change(&mut self, made: FleetChange) {
        let d = self.d();
        let known = |h: &str| d.shared.tokens.read().unwrap().iter().any(|(t, _)| t == h);
        let held = match &made {
            FleetChange::TokenMade { hash, .. } => known(hash),
            FleetChange::TokensRevoked { hashes } => !hashes.iter().any(|h| known(h)),
            FleetChange::Drain(want) => d.th.fleet_drain == *want,
            // Taken unless the scope already has a newer one (or is not used here).
            FleetChange::Control { scope, receipt } => d
                .engine
                .scopes()
                .get(scope)
                .is_none_or(|s| s.generation >= receipt.generation),
        };
        if !held {
            self.wrong(format!("answered, but the mirror does not have {made:?}"));
        }
    }

    /// The store as this host's link reaches it (refused while cut), or as the peer
    /// does.
    fn fleet_store(&mut self, peer: bool) -> Box<dyn FleetStore> {
        let f = self.fleet.as_ref().expect("a fleet seed");
        match peer {
            true => Box::new(f.store.clone()),
            false => Box::new(f.reach()),
        }
    }

    fn fleet_down(&self) -> bool {
        let f = self.fleet.as_ref().expect("a fleet seed");
        f.down.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// After a heartbeat that reached the store: the mirror is the store's.
    pub(super) fn check_mirror(&mut self) {
        if self.daemon.is_none() || self.fleet_down() {
            return;
        }
        let Ok(Some(store)) = self.fleet_store(true).shared(-1) else {
            self.wrong("the fleet store did not answer a read".into());
        };
        let want: BTreeMap<String, String> = (store.tokens.iter())
            .map(|t| (t.hash.clone(), t.grant.clone()))
            .collect();
        let d = self.d();
        let have: BTreeMap<String, String> = (d.shared.tokens.read().unwrap().iter())
            .filter(|(_, g)| g.fleet)
            .map(|(h, g)| (h.clone(), g.stored()))
            .collect();
        let drain = d.th.fleet_drain.clone();
        let draining = d.engine.is_draining();
        // Every scope used here has the fleet's control.
        let controls: Vec<String> = (store.controls.iter())
            .filter_map(|c| {
                let s = d.engine.scopes().get(&c.scope)?;
                let same = (s.control, s.generation) == (c.control, c.generation);
                (!same).then(|| {
                    format!(
                        "{}: {:?} g{} vs the fleet's {c:?}",
                        c.scope, s.control, s.generation
                    )
                })
            })
            .collect();
        // No project rides on evidence the fleet does not hold valid. (The other way
        // may differ: a host drops evidence a run of its own refuted, and tells the
        // fleet; told while the store is away, that is lost, and the host stays serial.)
        let fleet = |p: &str, e: &berth_core::Evidence| {
            (store.evidence.iter()).any(|x| {
                x.project == p
                    && x.valid
                    && (x.fingerprint.as_str(), x.commit.as_deref())
                        == (e.fingerprint.as_str(), e.commit.as_deref())
            })
        };
        let wrong: Vec<String> = (d.engine.snapshot().projects.into_iter())
            .filter_map(|p| {
                let e = p.evidence?;
                (!fleet(&p.name, &e)).then(|| format!("{}: {e:?}", p.name))
            })
            .collect();
        if !wrong.is_empty() {
            self.wrong(format!(
                "after a heartbeat a project's evidence is not the fleet's: {wrong:?}"
            ));
        }
        if !controls.is_empty() {
            self.wrong(format!(
                "after a heartbeat a scope's control is not the fleet's: {controls:?}"
            ));
        }
        if have != want || drain != store.drain || (drain.is_some() && !draining) {
            self.wrong(format!(
                "after a heartbeat the mirror is not the store's: tokens {have:?} vs {want:?}, drain {drain:?} vs {:?}, engine draining {draining}",
                store.drain
            ));
        }
    }
}
