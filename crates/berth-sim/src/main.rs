//! `berth-sim --seeds N`: runs N seeds of the deterministic simulator, each twice, and
//! fails if any trace differs, any invariant breaks, or any foreground head waits longer
//! beyond the starvation guard than the bound in docs/design.md.

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;

#[derive(Parser)]
#[command(about = "Seeded deterministic simulator for berth's admission engine")]
struct Args {
    /// How many seeds to run (each twice); at least 1, so a run that checked
    /// nothing can never pass (`BERTH_SIM_SEEDS=0` once did).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..))]
    seeds: u64,
    /// The first seed.
    #[arg(long, default_value_t = 1)]
    first: u64,
    /// Steps per seed.
    #[arg(long, default_value_t = berth_sim::Params::default().steps)]
    steps: usize,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let params = berth_sim::Params {
        steps: args.steps,
        ..Default::default()
    };
    let started = Instant::now();
    let (mut failures, mut grants, mut commands) = (0u64, 0u64, 0u64);
    let (mut worst, mut worst_seed, mut bound) = (0u64, 0u64, 0u64);
    let (mut promotions, mut demotions, mut degraded, mut expired) = (0u64, 0u64, 0u64, 0u64);
    let (mut stale_fences, mut lease_expiries) = (0u64, 0u64);
    let mut max_queue = 0usize;
    for seed in args.first..args.first + args.seeds {
        match berth_sim::run_twice(seed, &params) {
            Ok(r) => {
                grants += r.grants;
                commands += r.commands;
                promotions += r.promotions;
                demotions += r.demotions;
                degraded += r.degraded;
                expired += r.expired;
                stale_fences += r.stale_fences_refused;
                lease_expiries += r.lease_expiries;
                max_queue = max_queue.max(r.max_queue);
                bound = r.bound_ms;
                if r.max_head_beyond_guard_ms >= worst {
                    worst = r.max_head_beyond_guard_ms;
                    worst_seed = seed;
                }
            }
            Err(e) => {
                failures += 1;
                eprintln!("FAIL {e}");
            }
        }
    }
    println!(
        "{{\"seeds\":{},\"failures\":{failures},\"commands\":{commands},\"grants\":{grants},\"promotions\":{promotions},\"demotions\":{demotions},\"degraded\":{degraded},\"expired\":{expired},\"lease_expiries\":{lease_expiries},\"stale_fences_refused\":{stale_fences},\"max_queue\":{max_queue},\"max_head_beyond_guard_ms\":{worst},\"worst_seed\":{worst_seed},\"bound_ms\":{bound},\"seconds\":{:.1}}}",
        args.seeds,
        started.elapsed().as_secs_f64()
    );
    let passed = args.seeds - failures;
    println!("berth-sim: {passed} passed, {failures} failed");
    if failures > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
