//! Run workspaces (W1): `<state_dir>/runs/<digest>/{tmp,logs,cache,browser,out}`, mode
//! 0700, created and removed through directory file descriptors with `O_NOFOLLOW`, so a
//! symlink planted in the path is never followed. The (device, inode) pair goes into the
//! ledger and must match before anything is removed.
//!
//! A run controls every file in its workspace, and berth often runs as root, so every
//! walk over a workspace's contents (removal, the clean check, archiving its logs) goes
//! through `crate::walk`: iterative with bounded descriptors whatever the depth, never
//! following a link, never crossing a mount point. A workspace with a mount inside is
//! neither recycled nor scrubbed: it stays in the trash until it is unmounted.
//!
//! One file per job: `dir` (one workspace on disk, through descriptors), `pool` (the
//! ready-made workspaces and the thread that judges released ones), `watch` (inotify
//! over pooled workspaces), `diagnostics` (archiving a workspace's logs within budgets),
//! `names` (what trash and pool entry names record).

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

/// A workspace's subdirectories, each with the variable that tells the run where it is
/// (W1). `env` spells them all; `SUBDIRS` is the same names, in the same order.
pub const SUBDIR_ENV: [(&str, &str); 5] = [
    ("tmp", "BERTH_TMP_DIR"),
    ("logs", "BERTH_LOG_DIR"),
    ("cache", "BERTH_CACHE_DIR"),
    ("browser", "BERTH_BROWSER_DIR"),
    ("out", "BERTH_OUTPUT_DIR"),
];

pub const SUBDIRS: [&str; 5] = {
    let mut names = [""; 5];
    let mut i = 0;
    while i < names.len() {
        names[i] = SUBDIR_ENV[i].0;
        i += 1;
    }
    names
};

/// The variables that locate the workspace at `path` for its run: `BERTH_WORKSPACE`,
/// one per subdirectory, and `TMPDIR` (the run's own `tmp`, so tools that honour it
/// never share the host's).
pub fn env(path: &str, env: &mut BTreeMap<std::borrow::Cow<'static, str>, String>) {
    env.insert("BERTH_WORKSPACE".into(), path.to_string());
    for (dir, var) in SUBDIR_ENV {
        env.insert(var.into(), format!("{path}/{dir}"));
    }
    env.insert("TMPDIR".into(), format!("{path}/tmp"));
}

#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    #[error("workspace {path}: {op}: {err}")]
    Io {
        path: String,
        op: &'static str,
        err: std::io::Error,
    },
    #[error("workspace {path} is not the directory berth created (identity mismatch); left alone")]
    Swapped { path: String },
    /// A mount point in the workspace (or over it): nothing under it is deleted, and
    /// the workspace stays until it is unmounted.
    #[error("workspace {path} has a mount point inside; nothing under it was removed; left for a later retry")]
    Mounted { path: String },
}

/// A run's workspace directory name: a digest, so any run id maps to a safe name.
pub fn dir_name(run_id: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let d = Sha256::digest(run_id.as_bytes());
    // By hand: a `format!` per byte was 17 allocations per grant.
    let mut name = String::with_capacity(32);
    for b in &d[..16] {
        name.push(char::from(HEX[usize::from(b >> 4)]));
        name.push(char::from(HEX[usize::from(b & 15)]));
    }
    name
}

mod diagnostics;
mod dir;
mod names;
mod pool;
#[cfg(test)]
mod tests;
mod watch;

pub use diagnostics::{
    Diagnostics, DiagnosticsCounters, ARCHIVE_DEPTH_MAX, ARCHIVE_VISITS_MAX,
    DIAGNOSTICS_RUN_ENTRIES_MAX, DIAGNOSTICS_TOTAL_ENTRIES_MAX,
};
pub use dir::{create, create_owned, ensure_runs_dir, ensure_users_dir, remove};
pub use pool::{Pool, POOL_MAX, POOL_TARGET};
