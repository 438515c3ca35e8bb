//! The thin runtime around [`Daemon`]: it reads the clock, samples memory and feeds
//! the daemon its messages and ticks. Nothing here decides anything.

use tokio::sync::mpsc;

use super::{Daemon, Host, Msg, Shell};
use crate::clock;

/// Runs the daemon until every sender is gone.
pub async fn run<H: Host>(
    mut st: Daemon<H>,
    shell: Shell,
    mut rx: mpsc::Receiver<Msg>,
    tick_ms: u64,
    sample_memory: bool,
    probe: Option<crate::CommitProbe>,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(tick_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_sample = 0u64;
    loop {
        tokio::select! {
            msg = rx.recv() => match msg {
                Some(m) => {
                    shell.carry_out(st.handle(clock::mono_ms(), m));
                    if let Some(p) = &probe {
                        p.0.store(shell.commits(), std::sync::atomic::Ordering::Relaxed);
                    }
                }
                None => break,
            },
            _ = tick.tick() => {
                let now = clock::mono_ms();
                let sample = if sample_memory && now >= last_sample + 1000 {
                    last_sample = now;
                    crate::host::memory_available()
                } else {
                    None
                };
                shell.carry_out(st.tick(now, sample));
            }
        }
    }
    shell.close(st);
}
