//! W3: the port broker. Which ports of the configured range live runs hold, and the
//! choice of new ones. Pure: whether something outside berth uses a port is asked of
//! the host (a bind test) through the closure `allocate` is given.

use std::collections::BTreeMap;

pub(super) struct PortBroker {
    lo: u16,
    hi: u16,
    /// Where the next search starts: ports are handed out round the range, so a port
    /// just given back is the last to be handed out again (a client of the old run may
    /// still be talking to it).
    next: u16,
    held: BTreeMap<u16, String>,
}

impl PortBroker {
    pub(super) fn new((lo, hi): (u16, u16)) -> PortBroker {
        PortBroker {
            lo,
            hi,
            next: lo,
            held: BTreeMap::new(),
        }
    }

    /// A restored run's port (P5). A port outside the range (the range was changed
    /// between starts) is held all the same: its run still listens on it.
    pub(super) fn hold(&mut self, port: u16, run_id: &str) {
        self.held.insert(port, run_id.to_string());
    }

    /// `n` free ports for `run_id`, or `None` (holding nothing) when the range has not
    /// that many that are neither held nor in use outside berth (`in_use`). At most one
    /// pass over the range: bounded by its size.
    pub(super) fn allocate(
        &mut self,
        run_id: &str,
        n: usize,
        mut in_use: impl FnMut(u16) -> bool,
    ) -> Option<Vec<u16>> {
        let size = (self.hi - self.lo) as usize + 1;
        let mut got = Vec::with_capacity(n);
        let mut p = self.next;
        for _ in 0..size {
            if got.len() == n {
                break;
            }
            if !self.held.contains_key(&p) && !in_use(p) {
                got.push(p);
            }
            p = if p >= self.hi { self.lo } else { p + 1 };
        }
        if got.len() < n {
            return None;
        }
        self.next = p;
        for &q in &got {
            self.held.insert(q, run_id.to_string());
        }
        Some(got)
    }

    /// The run has ended: its ports come back (only those it holds).
    pub(super) fn release(&mut self, run_id: &str, ports: &[u16]) {
        for p in ports {
            if self.held.get(p).is_some_and(|r| r == run_id) {
                self.held.remove(p);
            }
        }
    }

    /// Who holds `port` (the simulator's and the tests' view).
    #[cfg(test)]
    pub(super) fn holder(&self, port: u16) -> Option<&str> {
        self.held.get(&port).map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::PortBroker;

    #[test]
    fn ports_are_never_handed_out_twice_skip_outside_users_and_come_back() {
        let mut b = PortBroker::new((100, 104));
        assert_eq!(b.allocate("a", 2, |_| false), Some(vec![100, 101]));
        // 102 is used by something outside berth: skipped.
        assert_eq!(b.allocate("b", 2, |p| p == 102), Some(vec![103, 104]));
        // Only 102 is left, and it is in use: nothing is taken.
        assert_eq!(b.allocate("c", 1, |p| p == 102), None);
        assert_eq!(b.holder(100), Some("a"));
        b.release("a", &[100, 101]);
        assert_eq!(b.allocate("c", 1, |_| false), Some(vec![100]));
        // A port handed back is not handed out first: the search goes on round.
        b.release("c", &[100]);
        assert_eq!(b.allocate("d", 1, |_| false), Some(vec![101]));
        // Releasing someone else's port changes nothing.
        b.release("x", &[101]);
        assert_eq!(b.holder(101), Some("d"));
        assert_eq!(b.holder(100), None);
    }
}
