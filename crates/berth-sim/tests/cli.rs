//! The simulator's command line.

/// Issue 17: `BERTH_SIM_SEEDS=0` passed with nothing run. Fewer than one seed is a
/// usage error now, and one seed really runs.
#[test]
fn zero_seeds_is_refused_and_one_seed_runs() {
    let bin = env!("CARGO_BIN_EXE_berth-sim");
    let out = std::process::Command::new(bin)
        .args(["--seeds", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--seeds"), "{err}");
    let out = std::process::Command::new(bin)
        .args(["--seeds", "1", "--steps", "200"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("berth-sim: 1 passed, 0 failed"), "{text}");
}
