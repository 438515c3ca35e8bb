//! What the fuzz tests (`fuzz_http.rs`, `fuzz_config.rs`, `fuzz_ledger.rs`; issue 16,
//! item 4) share: how many cases a run tries, its seed, the proptest runner built from
//! them, and the one line each prints.
//!
//! CI has only the stable toolchain, so these are proptest-driven harnesses rather than
//! cargo-fuzz targets: the same structured-then-mutated inputs, a fixed seed (the
//! default run is the same run every time, so a failure in it is reproducible), and
//! proptest's shrinking to cut a failing case down before it is printed.
#![allow(dead_code)] // Each test binary uses its part.

use proptest::test_runner::{Config, RngAlgorithm, TestError, TestRng, TestRunner};

/// The seed of every run unless `BERTH_FUZZ_SEED` names another ("berthfuz").
pub const SEED_DEFAULT: u64 = 0x6265_7274_6866_757a;
/// Shrink steps at most: a failing case is cut down, but a stateful target (a daemon)
/// gives a shrink no guarantee, so it is not allowed to run for long.
pub const SHRINK_ITERS_MAX: u32 = 256;

/// How many cases this run tries: `BERTH_FUZZ_CASES` (the long run), else `default`
/// (the short run every `cargo test` makes).
pub fn cases(default: u32) -> u32 {
    match std::env::var("BERTH_FUZZ_CASES") {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("BERTH_FUZZ_CASES={v:?} is not a whole number")),
        Err(_) => default,
    }
}

/// The seed: fixed unless `BERTH_FUZZ_SEED` names another (a long run may want several).
pub fn seed() -> u64 {
    match std::env::var("BERTH_FUZZ_SEED") {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("BERTH_FUZZ_SEED={v:?} is not a whole number")),
        Err(_) => SEED_DEFAULT,
    }
}

/// A runner of `cases` cases on the seed's ChaCha stream, remembering no failures on
/// disk (a regression found here becomes a named test instead).
pub fn runner(cases: u32) -> TestRunner {
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: SHRINK_ITERS_MAX,
        rng_algorithm: RngAlgorithm::ChaCha,
        ..Config::default()
    };
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed().to_le_bytes());
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
}

/// Fails the test with proptest's verdict and the (shrunk) case that caused it.
pub fn verdict<T: std::fmt::Debug>(what: &str, result: Result<(), TestError<T>>) {
    match result {
        Ok(()) => {}
        Err(TestError::Fail(why, case)) => {
            panic!(
                "{what}: {why}\nminimal failing case (seed {}): {case:#?}",
                seed()
            )
        }
        Err(TestError::Abort(why)) => panic!("{what}: aborted: {why}"),
    }
}

/// The one line a fuzz test prints (on stderr, past the harness's capture), e.g.
/// `fuzz-http: cases=800 refused=540`; `what` follows when one name covers several
/// targets (`fuzz-toml: cases=2000 refused=1468 file=berth.toml`).
pub fn report(name: &str, cases: u64, refused: u64, what: &str) {
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "{name}: cases={cases} refused={refused}{what}"
    );
}

/// A process that outlives any test by far (`sleep 3600`), in its own process group:
/// what a fuzz registers with a run, so a stop that berth carries out kills only it.
/// It never holds the test's output open, is killed when dropped, and dies with the
/// test's thread even if the test binary exits without dropping it.
pub struct Sleeper(pub std::process::Child);

impl Sleeper {
    pub fn start() -> Sleeper {
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new("sleep");
        cmd.arg("3600")
            .process_group(0)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        // SAFETY: prctl is async-signal-safe; nothing else runs in the child.
        unsafe {
            cmd.pre_exec(|| {
                rustix::process::set_parent_process_death_signal(Some(
                    rustix::process::Signal::KILL,
                ))
                .map_err(std::io::Error::from)
            });
        }
        Sleeper(cmd.spawn().expect("start sleep"))
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Whether it has ended (a run's stop killed it).
    pub fn ended(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(Some(_)))
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
