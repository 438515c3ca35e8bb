//! inotify over pooled workspaces: a workspace none of whose directories saw an event
//! since it was proven clean is still clean.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd};

use rustix::fs::inotify;

use super::{pool::*, *};

/// What a watch reports: any change to a directory's entries or to its attributes, and
/// its deletion. `IN_MOVE_SELF` is left out: the pool's own renames of a workspace are
/// not changes to it (its subdirectories moving shows as `IN_MOVED_FROM` on the top).
pub(super) fn watch_flags() -> inotify::WatchFlags {
    use inotify::WatchFlags as W;
    W::CREATE | W::DELETE | W::MOVED_FROM | W::MOVED_TO | W::ATTRIB | W::DELETE_SELF | W::ONLYDIR
}

/// inotify watches on workspaces' six directories, by identity. A workspace is vouched
/// for while none of its watches reported an event since it was last proven clean.
/// Sound because inotify queues an event inside the system call that makes the change:
/// once `drain` has read the queue, every change made before it was called is known.
pub(super) struct Watcher {
    fd: Option<OwnedFd>,
    by_wd: HashMap<i32, Ident>,
    by_ident: HashMap<Ident, Watched>,
    buf: Vec<MaybeUninit<u8>>,
}

pub(super) struct Watched {
    wds: Vec<i32>,
    dirty: bool,
}

/// Bytes read from the event queue per `read`.
pub(super) const EVENT_BUF_BYTES: usize = 16 * 1024;

impl Watcher {
    pub(super) fn new() -> Watcher {
        let fd = inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)
            .map_err(|e| {
                tracing::warn!("workspace pool: no inotify ({e}); every release is scanned")
            })
            .ok();
        Watcher {
            fd,
            by_wd: HashMap::new(),
            by_ident: HashMap::new(),
            buf: vec![MaybeUninit::uninit(); EVENT_BUF_BYTES],
        }
    }

    /// Watches the workspace open as `dir`: the top, then each subdirectory. False when
    /// it cannot (no inotify, the user's watch limit reached, a subdirectory missing).
    pub(super) fn watch(&mut self, dir: &OwnedFd, ident: Ident) -> bool {
        self.forget(ident);
        let Some(fd) = &self.fd else { return false };
        // The magic link names exactly the directory open here, wherever it is now.
        let top = format!("/proc/self/fd/{}", dir.as_raw_fd());
        let mut wds = Vec::with_capacity(1 + SUBDIRS.len());
        let mut ok = true;
        for p in std::iter::once(top.clone()).chain(SUBDIRS.iter().map(|s| format!("{top}/{s}"))) {
            // DONT_FOLLOW only below the top (a link planted under a subdirectory's
            // name is not watched through; ONLYDIR then fails on it).
            let flags = if wds.is_empty() {
                watch_flags()
            } else {
                watch_flags() | inotify::WatchFlags::DONT_FOLLOW
            };
            match inotify::add_watch(fd, p.as_str(), flags) {
                Ok(wd) => wds.push(wd),
                Err(_) => {
                    ok = false;
                    break;
                }
            }
        }
        if !ok {
            for wd in wds {
                let _ = inotify::remove_watch(fd, wd);
            }
            return false;
        }
        for wd in &wds {
            self.by_wd.insert(*wd, ident);
        }
        self.by_ident.insert(ident, Watched { wds, dirty: false });
        true
    }

    pub(super) fn forget(&mut self, ident: Ident) {
        if let Some(w) = self.by_ident.remove(&ident) {
            self.unwatch(w.wds);
        }
    }

    pub(super) fn unwatch(&mut self, wds: Vec<i32>) {
        for wd in wds {
            self.by_wd.remove(&wd);
            if let Some(fd) = &self.fd {
                let _ = inotify::remove_watch(fd, wd);
            }
        }
    }

    pub(super) fn vouches(&self, ident: Ident) -> bool {
        self.by_ident.get(&ident).is_some_and(|w| !w.dirty)
    }

    /// Reads every queued event and marks the workspaces they concern dirty (all of
    /// them if the queue overflowed); returns those newly dirtied. A dirty workspace's
    /// watches are dropped at once, so a busy run cannot flood the queue.
    pub(super) fn drain(&mut self) -> Vec<Ident> {
        let Some(fd) = &self.fd else {
            return Vec::new();
        };
        let mut hit = Vec::new();
        let mut overflow = false;
        let mut reader = inotify::Reader::new(fd, &mut self.buf);
        loop {
            match reader.next() {
                Ok(ev) if ev.events().contains(inotify::ReadFlags::QUEUE_OVERFLOW) => {
                    overflow = true
                }
                Ok(ev) => {
                    if let Some(ident) = self.by_wd.get(&ev.wd()) {
                        hit.push(*ident);
                    }
                }
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    tracing::warn!("workspace pool: reading inotify events: {e}");
                    overflow = true;
                    break;
                }
            }
        }
        if overflow {
            hit.extend(self.by_ident.keys().copied());
        }
        let mut dirtied = Vec::new();
        for ident in hit {
            let wds = match self.by_ident.get_mut(&ident) {
                Some(w) if !w.dirty => {
                    w.dirty = true;
                    std::mem::take(&mut w.wds)
                }
                _ => continue,
            };
            self.unwatch(wds);
            dirtied.push(ident);
        }
        dirtied
    }
}
