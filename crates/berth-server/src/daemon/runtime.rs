//! The thin runtime around [`Daemon`]: it reads the clock, samples memory (what is
//! available, and the pressure on it) and feeds
//! the daemon its messages and ticks. Nothing here decides anything.

use std::path::PathBuf;

use tokio::sync::mpsc;

use super::{Daemon, Host, Msg, Sample, Shell};
use crate::clock;

/// What the runtime reads of the host once a second, for the daemon's next tick.
#[derive(Clone, Debug, Default)]
pub struct Sampler {
    /// MemAvailable (A10); off where only the configured totals count.
    pub memory: bool,
    /// Issue 36: memory pressure, from `/proc/pressure/memory` or a file in its format.
    pub pressure: Option<PathBuf>,
    /// Issue 36: cpu and io pressure, likewise (`/proc/pressure/cpu`, `…/io`).
    pub cpu_pressure: Option<PathBuf>,
    pub io_pressure: Option<PathBuf>,
    /// Issue 36: the workspaces' directory, whose file system's free space admission
    /// follows (sampled with memory: off where only the configured totals count).
    pub disk: Option<PathBuf>,
}

impl Sampler {
    fn read(&self) -> Sample {
        let psi = |p: &Option<PathBuf>| p.as_deref().and_then(crate::host::pressure_bp);
        Sample {
            mem_available: self.memory.then(crate::host::memory_available).flatten(),
            // By `PressureKind`: memory, cpu, io.
            pressure_bp: [
                psi(&self.pressure),
                psi(&self.cpu_pressure),
                psi(&self.io_pressure),
            ],
            disk_free: self.disk.as_deref().and_then(crate::host::disk_free),
        }
    }
}

/// Runs the daemon until every sender is gone.
pub async fn run<H: Host>(
    mut st: Daemon<H>,
    shell: Shell,
    mut rx: mpsc::Receiver<Msg>,
    tick_ms: u64,
    sampler: Sampler,
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
                let sample = (now >= last_sample + 1000).then(|| {
                    last_sample = now;
                    sampler.read()
                });
                shell.carry_out(st.tick(now, sample));
            }
        }
    }
    shell.close(st);
}
