//! `berth`: a thin binary. `serve` starts the daemon (berth-server); every other
//! subcommand is a client of its HTTP API.

mod client;
mod run;
mod serve;
mod show;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Exit codes (SPEC section 12).
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_REFUSED: u8 = 69;
pub const EXIT_TIMEOUT: u8 = 75;

#[derive(Parser)]
#[command(
    name = "berth",
    version,
    about = "Host admission and lease broker for agent runs and short jobs"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the daemon for this host.
    Serve(serve::ServeArgs),
    /// Wait for a berth, run CMD inside it, renew while it runs, release when it exits.
    Run(run::RunArgs),
    /// Show the host's capacity, queue and projects.
    Status(client::StatusArgs),
    /// List live runs (with --all, ended ones too).
    Runs(client::RunsArgs),
    /// Acquire a lease without running anything (for scripts; see --json).
    Acquire(run::AcquireArgs),
    /// Renew a lease (or a queued run's deadline).
    Renew(client::RenewArgs),
    /// Release a lease.
    Release(client::ReleaseArgs),
    /// Run one reaper pass now and print its report.
    Reap(client::ConnArgs),
}

/// See `[workspace.dependencies]` for why.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Serve(a) => serve::main(a),
        Cmd::Run(a) => run::run_main(a),
        Cmd::Status(a) => client::status_main(a),
        Cmd::Runs(a) => client::runs_main(a),
        Cmd::Acquire(a) => run::acquire_main(a),
        Cmd::Renew(a) => client::renew_main(a),
        Cmd::Release(a) => client::release_main(a),
        Cmd::Reap(a) => client::reap_main(a),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("berth: {e:#}");
            ExitCode::from(1)
        }
    }
}
