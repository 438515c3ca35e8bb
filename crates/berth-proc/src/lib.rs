//! berth-proc: knowing exactly which processes belong to a run, and stopping exactly
//! those (docs/contract.md, processes).
//!
//! - [`ProcId`]: a process is (pid, start time, boot id), never a pid alone (P1).
//!   [`signal`] opens a pidfd, re-checks the start time through it, and only then
//!   signals: a recycled pid can never be hit (P3).
//! - [`members`]: the pure rule that decides which live processes belong to a run in
//!   the process-group fallback.
//! - [`cgroup`]: a cgroup v2 group per run where the host allows it, and the
//!   controllers that hold it to its claim; [`limits`]: the pure claim-to-limits rule.
//! - [`StopPlan`]: the pure TERM → grace → KILL → proven-gone decision (P2).
//!
//! Two rules run through everything here. "Could not look" is never "gone" (S4): a
//! failed `/proc`, pidfd or cgroup read is an error or an explicit unknown, never an
//! empty list, so a stop never reports done on a look that failed. And some processes
//! are never signalled (S3): pid 1, kernel threads, the daemon itself and its
//! ancestors ([`is_kernel_thread`], [`ancestors_of`], [`is_protected`]).

pub mod cgroup;
pub mod limits;
pub mod net;
#[doc(hidden)]
pub mod testing;

mod ident;
mod stop;
mod stopper;
mod tree;

pub use ident::*;
pub use stop::{StopAction, StopPlan};
pub use stopper::*;
pub use tree::*;

use std::os::fd::OwnedFd;

use rustix::process::{Pid, PidfdFlags, Signal};

#[cfg(test)]
mod tests;
