//! `berth`: a thin binary. `serve` starts the daemon (berth-server); every other
//! subcommand is a client of its HTTP API.

mod args;
mod client;
mod events;
mod fleet;
mod lease;
mod run;
mod scopes;
mod serve;
mod show;
mod threads;
mod tokens;

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

/// Exit codes (docs/contract.md).
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_REFUSED: u8 = 69;
pub const EXIT_TIMEOUT: u8 = 75;
/// `berth run`: the kernel's OOM killer killed inside the run (it went past its hard
/// memory limit) and CMD did not succeed (issue 36). Outside sysexits' 64-78 and the
/// shell's 126-165, so it is told apart from CMD's own codes and signals.
pub const EXIT_OOM: u8 = 88;

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
    Serve(Box<serve::ServeArgs>),
    /// Wait for a berth, run CMD inside it, renew while it runs, release when it exits.
    Run(run::RunArgs),
    /// Show the host's capacity, queue and projects.
    Status(client::StatusArgs),
    /// List live runs (with --all, ended ones too).
    Runs(client::RunsArgs),
    /// Acquire a lease without running anything (for scripts; see --json).
    Acquire(run::AcquireArgs),
    /// Wait for a run (e.g. one acquired with --detach) to be granted; print its lease.
    Wait(client::WaitArgs),
    /// Renew a lease (or a queued run's deadline).
    Renew(client::RenewArgs),
    /// Release a lease.
    Release(client::ReleaseArgs),
    /// Run one reaper pass now and print its report.
    Reap(client::ConnArgs),
    /// Print the journal's recent events; with --follow, every new one as it happens.
    Events(events::EventsArgs),
    /// Show agent threads: owner, registration, workspace, evictions.
    Threads(threads::ThreadsArgs),
    /// Show the host's drain; --start --reason TEXT drains it (no new runs or
    /// registrations), --wait until nothing is in flight, --off ends it.
    Drain(threads::DrainArgs),
    /// Show or control an experiment scope: show, pause, stop, resume, reconcile.
    Scope(scopes::ScopeArgs),
    /// List the experiment scopes: control, generation, tokens held per harness.
    Budget(client::ConnArgs),
    /// Fleet mode: every live host's free capacity and queue, the fleet's sums, the
    /// dead hosts.
    Fleet(client::ConnArgs),
    /// Make, list and revoke tokens (admin): one per user, bound to their uid.
    Token(tokens::TokenArgs),
    /// Print a completion script for a shell, e.g. `berth completions bash >
    /// /etc/bash_completion.d/berth`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print a man page (roff): berth's, or a subcommand's (`berth man run | man -l -`);
    /// --install DIR writes every page (berth.1, berth-run.1, ...) into DIR.
    Man {
        /// The subcommand whose page to print, e.g. `run` or `scope show`.
        command: Vec<String>,
        /// Write every page into DIR (e.g. /usr/local/share/man/man1) instead.
        #[arg(long, value_name = "DIR", conflicts_with = "command")]
        install: Option<std::path::PathBuf>,
    },
}

/// See `[workspace.dependencies]` for why.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's way to give memory back: this thread's free pages, and every arena's
/// purged (the daemon asks after a deep queue drained: `berth_server::memory`).
fn release_memory() {
    // SAFETY: `mi_collect` takes no pointers and may be called from any thread.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

fn main() -> ExitCode {
    // berth run's gate in front of CMD: before clap, which must not read CMD's words.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().take(3).collect();
    if argv.get(1).is_some_and(|a| a == run::GATE_ARG) {
        let all: Vec<std::ffi::OsString> = std::env::args_os().skip(2).collect();
        return ExitCode::from(run::gate_main(&all));
    }
    berth_server::memory::set_release(release_memory);
    let cli = Cli::parse();
    // A client printing into a pipe its reader closed (`berth status | head -c 1`)
    // ends quietly as Unix tools do, by SIGPIPE, not with a panic (Rust ignores
    // SIGPIPE, and `println!` panics on EPIPE: issue 33 item 6). The daemon and
    // `berth run` keep ignoring it: they own sockets and a child, and say what fails.
    if !matches!(cli.cmd, Cmd::Serve(_) | Cmd::Run(_)) {
        // SAFETY: at start, before any thread exists; SIG_DFL is always valid.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let result = match cli.cmd {
        Cmd::Serve(a) => serve::main(*a),
        Cmd::Run(a) => run::run_main(a),
        Cmd::Status(a) => client::status_main(a),
        Cmd::Runs(a) => client::runs_main(a),
        Cmd::Acquire(a) => run::acquire_main(a),
        Cmd::Wait(a) => client::wait_main(a),
        Cmd::Renew(a) => client::renew_main(a),
        Cmd::Release(a) => client::release_main(a),
        Cmd::Reap(a) => client::reap_main(a),
        Cmd::Events(a) => events::events_main(a),
        Cmd::Threads(a) => threads::threads_main(a),
        Cmd::Drain(a) => threads::drain_main(a),
        Cmd::Scope(a) => scopes::scope_main(a),
        Cmd::Budget(a) => scopes::budget_main(a),
        Cmd::Fleet(a) => fleet::fleet_main(a),
        Cmd::Token(a) => tokens::token_main(a),
        Cmd::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "berth", &mut std::io::stdout());
            Ok(0)
        }
        Cmd::Man { command, install } => man_main(&command, install.as_deref()),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("berth: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// `berth man [COMMAND...]` and `berth man --install DIR`: one page per subcommand,
/// named as the top page's SEE ALSO names them (`berth-run(1)`).
fn man_main(path: &[String], install: Option<&std::path::Path>) -> anyhow::Result<u8> {
    let mut cmd = Cli::command().disable_help_subcommand(true);
    cmd.build();
    if let Some(dir) = install {
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("--install {}: {e}", dir.display()))?;
        clap_mangen::generate_to(cmd, dir)
            .map_err(|e| anyhow::anyhow!("--install {}: {e}", dir.display()))?;
        println!("man pages written to {}", dir.display());
        return Ok(0);
    }
    let mut page = cmd;
    for word in path {
        let Some(sub) = page.find_subcommand(word).cloned() else {
            eprintln!(
                "berth: man: no subcommand {:?} (see `berth --help`)",
                path.join(" ")
            );
            return Ok(EXIT_USAGE);
        };
        page = sub;
    }
    clap_mangen::Man::new(page).render(&mut std::io::stdout())?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every flag and argument of every command says what it is (units and defaults
    /// are in the text), and every command has an about line.
    #[test]
    fn every_flag_has_help() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                let id = a.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                if a.get_help().is_none() && a.get_long_help().is_none() {
                    missing.push(format!("{path} {id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                let p = format!("{path} {}", sub.get_name());
                if sub.get_about().is_none() && sub.get_name() != "help" {
                    missing.push(format!("{p} (about)"));
                }
                walk(sub, &p, missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "berth", &mut missing);
        assert!(missing.is_empty(), "without help: {missing:#?}");
    }

    /// Issue 34: the README's configuration table lists every flag of `berth serve`
    /// (it left out the fleet, thread and ledger flags).
    #[test]
    fn the_readme_configuration_table_lists_every_serve_flag() {
        let readme = include_str!("../../../README.md");
        let at = readme
            .find("| flag | `berth.toml` key | default |")
            .expect("the configuration table");
        let table = &readme[at..at + readme[at..].find("\n\n").unwrap_or(0)];
        let cli = Cli::command();
        let serve = cli.find_subcommand("serve").expect("serve");
        let missing: Vec<String> = serve
            .get_arguments()
            .filter(|a| !a.is_hide_set())
            .filter_map(|a| a.get_long())
            .filter(|l| *l != "help" && !table.contains(&format!("`--{l}")))
            .map(|l| format!("--{l}"))
            .collect();
        assert!(
            missing.is_empty(),
            "not in README's configuration table: {missing:?}"
        );
    }

    /// The specification's rule ids (`G0-G3`, `B1/B2`, `F4`) mean nothing to a user:
    /// no help text carries one (issue 33 item 7).
    #[test]
    fn no_help_text_names_a_contract_id() {
        fn is_id(w: &str) -> bool {
            let b = w.as_bytes();
            b.len() >= 2
                && b.len() <= 3
                && b[0].is_ascii_uppercase()
                && b[1..].iter().all(u8::is_ascii_digit)
        }
        fn texts(cmd: &clap::Command, path: &str, found: &mut Vec<String>) {
            let mut all: Vec<String> = [cmd.get_about(), cmd.get_long_about()]
                .into_iter()
                .flatten()
                .map(|t| t.to_string())
                .collect();
            for a in cmd.get_arguments() {
                all.extend(
                    [a.get_help(), a.get_long_help()]
                        .into_iter()
                        .flatten()
                        .map(|t| t.to_string()),
                );
            }
            for t in all {
                let words = t.split(|c: char| !c.is_ascii_alphanumeric());
                if words.clone().any(is_id) {
                    found.push(format!("{path}: {t}"));
                }
            }
            for sub in cmd.get_subcommands() {
                texts(sub, &format!("{path} {}", sub.get_name()), found);
            }
        }
        let mut found = Vec::new();
        texts(&Cli::command(), "berth", &mut found);
        assert!(found.is_empty(), "contract ids in --help: {found:#?}");
    }
}
