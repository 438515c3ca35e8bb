//! Giving freed memory back to the system once a deep queue has drained.
//!
//! The allocator is the binary's choice (`#[global_allocator]`), so the binary says how
//! to ask it (`set_release`); without that, asking does nothing. berth's binaries use
//! mimalloc, which keeps the pages a thread freed until that thread allocates again and
//! purges them only then (after a delay): a daemon that goes quiet after 100,000
//! waiters left would otherwise keep their memory, about 50 MiB of it, indefinitely.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

static RELEASE: OnceLock<fn()> = OnceLock::new();
static RELEASES: AtomicU64 = AtomicU64::new(0);

/// How this process's allocator gives free memory back (set once, at start).
pub fn set_release(f: fn()) {
    let _ = RELEASE.set(f);
}

/// Asks the allocator to give its free memory back (the daemon's host calls this
/// after a drain: rarely, and never on the request path).
pub fn release() {
    RELEASES.fetch_add(1, Ordering::Relaxed);
    if let Some(f) = RELEASE.get() {
        f();
    }
}

/// How many times memory was given back so far (for tests and the log).
pub fn releases() -> u64 {
    RELEASES.load(Ordering::Relaxed)
}
