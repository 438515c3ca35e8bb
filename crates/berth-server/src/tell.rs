//! How a thread outside the daemon reports to it without knowing its message type:
//! the runtime hands the fleet threads and the listener watcher a [`Tell`] that wraps
//! what they report into the daemon's `Msg` and sends it to the daemon's inbox. So the
//! reporting modules depend on nothing above them.
//!
//! **Architecture invariant:** no module below `daemon` names `daemon::Msg`.

use std::sync::Arc;

use tokio::sync::mpsc;

/// Sends a `T` to the daemon from a blocking thread.
pub struct Tell<T> {
    send: Arc<dyn Fn(T) -> bool + Send + Sync>,
    alive: Arc<dyn Fn() -> bool + Send + Sync>,
}

impl<T> Clone for Tell<T> {
    fn clone(&self) -> Self {
        Tell {
            send: self.send.clone(),
            alive: self.alive.clone(),
        }
    }
}

impl<T: 'static> Tell<T> {
    /// Tells `inbox` each `T` as `wrap(T)`. Weak: a `Tell` never keeps the daemon's
    /// inbox open once the daemon has gone.
    pub fn to<M: Send + 'static>(inbox: mpsc::WeakSender<M>, wrap: fn(T) -> M) -> Tell<T> {
        let alive = inbox.clone();
        Tell {
            send: Arc::new(move |v| match inbox.upgrade() {
                Some(tx) => tx.blocking_send(wrap(v)).is_ok(),
                None => false,
            }),
            alive: Arc::new(move || alive.upgrade().is_some()),
        }
    }

    /// Tells `send` each `T` (the simulator collects them to deliver when it chooses).
    #[cfg(test)]
    pub fn to_fn(send: impl Fn(T) -> bool + Send + Sync + 'static) -> Tell<T> {
        Tell {
            send: Arc::new(send),
            alive: Arc::new(|| true),
        }
    }

    /// Tells the daemon; false once it is gone.
    pub fn send(&self, v: T) -> bool {
        (self.send)(v)
    }

    /// Whether the daemon is still there to be told.
    pub fn alive(&self) -> bool {
        (self.alive)()
    }
}
