//! Issue 38 Build 3 in the daemon simulator: the fleet's tokens and drain change, made
//! by this host (the store first, then `Msg::FleetChanged`, as the API does) or by the
//! peer (the store only: this host learns at its next heartbeat's read), with the link
//! cut at times and the daemon crashing between. Checked after each heartbeat that
//! reached the store: this host's mirror is the store's (its fleet tokens, its fleet
//! drain), and the engine drains while a fleet drain is mirrored. Checked after each
//! change this host made: the mirror has it before the caller is answered.

use std::collections::BTreeMap;

use berth_store::fleet::{FleetDrain, FleetStore, FleetToken};

use super::fleet::{HOST, PEER};
use super::Sim;
use crate::auth::{Grant, Scope};
use crate::daemon::{FleetChange, Msg};

impl Sim {
    /// One change of the fleet's tokens or drain, by this host or the peer.
    pub(super) fn shared_turn(&mut self) -> String {
        let by_peer = self.rng.chance(0.5);
        let mut s = self.fleet_store(by_peer);
        let what = self.rng.range(0, 3);
        let change = match what {
            0 => {
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
                    host_id: if by_peer { PEER } else { HOST }.into(),
                };
                let v = s.put_token(&row);
                v.map(|v| (FleetChange::TokenMade { hash, grant }, v))
            }
            1 => {
                let known = self.fleet_store(true).shared(-1).ok().flatten();
                let known = known.map(|sh| sh.tokens);
                let Some(t) = known.and_then(|t| t.first().cloned()) else {
                    return "shared: no fleet token to revoke".into();
                };
                let r = s.revoke_token(&t.hash[..16]);
                r.map(|(gone, v)| {
                    let hashes = gone.into_iter().map(|t| t.hash).collect();
                    (FleetChange::TokensRevoked { hashes }, v)
                })
            }
            _ => {
                let on = self.rng.chance(0.5);
                let d = on.then(|| FleetDrain {
                    by: "uid 0 (admin token)".into(),
                    at: format!("t{}", self.now),
                    reason: "sim".into(),
                    host_id: if by_peer { PEER } else { HOST }.into(),
                });
                let r = s.set_drain(d.as_ref());
                r.map(|(now, v)| (FleetChange::Drain(now), v))
            }
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

    /// A change this host made is in its mirror when the caller is answered.
    fn check_own_change(&mut self, made: FleetChange) {
        let d = self.d();
        let known = |h: &str| d.shared.tokens.read().unwrap().iter().any(|(t, _)| t == h);
        let held = match &made {
            FleetChange::TokenMade { hash, .. } => known(hash),
            FleetChange::TokensRevoked { hashes } => !hashes.iter().any(|h| known(h)),
            FleetChange::Drain(want) => d.th.fleet_drain == *want,
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
            false => Box::new(super::fleet::Reach {
                store: f.store.clone(),
                down: f.down.clone(),
            }),
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
        if have != want || drain != store.drain || (drain.is_some() && !draining) {
            self.wrong(format!(
                "after a heartbeat the mirror is not the store's: tokens {have:?} vs {want:?}, drain {drain:?} vs {:?}, engine draining {draining}",
                store.drain
            ));
        }
    }
}
