//! S10: what one token may hold open at once. A token holder's event streams and
//! long polls each keep a connection, a task and buffers for as long as they last;
//! without a cap per token, one read token took every connection the daemon had and
//! everyone's leases expired. Counts live here, taken when a stream or a wait starts
//! and given back when its [`Slot`] drops (the connection closing drops it).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::ApiError;

/// Event streams (`GET /v1/events`) one token may hold open at once.
pub const TOKEN_STREAMS_MAX_DEFAULT: usize = 64;
/// Long polls (a waiting acquire, long-polled or streamed; `GET /v1/runs/{id}?wait_s`)
/// one token may hold open at once: an orchestrator's waiters share its token.
pub const TOKEN_WAITS_MAX_DEFAULT: usize = 256;

/// What a slot is held for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Stream,
    Wait,
}

type Held = Arc<Mutex<HashMap<(u64, Kind), usize>>>;

/// The caps and the counts, per token (by a key of its hash, never the token).
pub struct Limits {
    streams_max: usize,
    waits_max: usize,
    held: Held,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits::new(TOKEN_STREAMS_MAX_DEFAULT, TOKEN_WAITS_MAX_DEFAULT)
    }
}

/// One stream or wait of one token; counted until dropped.
pub struct Slot {
    held: Held,
    key: (u64, Kind),
}

impl Limits {
    pub fn new(streams_max: usize, waits_max: usize) -> Limits {
        Limits {
            streams_max,
            waits_max,
            held: Held::default(),
        }
    }

    /// A slot of `kind` for `token` (`None`: no auth, uncapped), or `429` naming the cap.
    pub fn take(&self, token: Option<u64>, kind: Kind) -> Result<Option<Slot>, ApiError> {
        let Some(t) = token else { return Ok(None) };
        let (max, what, code) = match kind {
            Kind::Stream => (self.streams_max, "event streams", "too_many_streams"),
            Kind::Wait => (self.waits_max, "long polls", "too_many_waits"),
        };
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let n = held.entry((t, kind)).or_default();
        if *n >= max {
            return Err(ApiError::new(
                429,
                code,
                format!("this token has {max} {what} open, its cap (S10): close one first"),
            )
            .with(serde_json::json!({ "max": max })));
        }
        *n += 1;
        Ok(Some(Slot {
            held: self.held.clone(),
            key: (t, kind),
        }))
    }

    /// Slots of `kind` held by `token` now.
    pub fn held(&self, token: u64, kind: Kind) -> usize {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.get(&(token, kind)).copied().unwrap_or(0)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = held.get_mut(&self.key) {
            *n -= 1;
            // No entry per token that ever held one: the map is as big as what is open.
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_holds_at_most_its_cap_and_gets_slots_back_when_they_drop() {
        let l = Limits::new(2, 3);
        let a: Vec<_> = (0..2)
            .map(|_| l.take(Some(7), Kind::Stream).unwrap())
            .collect();
        let e = l.take(Some(7), Kind::Stream).err().expect("past the cap");
        assert_eq!((e.status, e.code.as_str()), (429, "too_many_streams"));
        // Another token, and another kind, have their own counts; no auth has none.
        assert!(l.take(Some(8), Kind::Stream).unwrap().is_some());
        assert!(l.take(Some(7), Kind::Wait).unwrap().is_some());
        assert!(l.take(None, Kind::Stream).unwrap().is_none());
        drop(a);
        assert_eq!(l.held(7, Kind::Stream), 0);
        assert!(
            l.held.lock().unwrap().is_empty(),
            "nothing kept for idle tokens"
        );
        assert!(l.take(Some(7), Kind::Stream).unwrap().is_some());
    }
}
