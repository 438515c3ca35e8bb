#!/usr/bin/env bash
# berth's reliability figures from real runs, in one command (issue 16):
#
#   scripts/reliability.sh [KILLS]          default 1000 daemon crashes
#
# Builds berth with its failpoints (release, in target/failpoints) and berth-bench, then
# `berth-bench reliability` runs: the fuzz and linearizability tests in their long form
# (malformed inputs tried and refused, histories checked), KILLS daemon crashes under
# load (every other one at a failpoint, in turn) with the acknowledged operations
# checked after each restart, killed `berth run` clients, and strangers under forced
# pid reuse. One JSON line. CLIENT_KILLS, STRANGERS, FUZZ_CASES, LINCHECK_OPS and
# LINCHECK_RESTARTS size the other parts.
set -euo pipefail
cd "$(dirname "$0")/.."
kills=${1:-1000}
cargo build --release --locked -q -p berth --features failpoints --target-dir target/failpoints
cargo build --release --locked -q -p berth-bench
exec target/release/berth-bench reliability --berth target/failpoints/release/berth \
  --kills "$kills" --client-kills "${CLIENT_KILLS:-100}" --strangers "${STRANGERS:-100}" \
  --test-env "BERTH_FUZZ_CASES=${FUZZ_CASES:-5000}" \
  --test-env "BERTH_LINCHECK_OPS=${LINCHECK_OPS:-50000}" \
  --test-env "BERTH_LINCHECK_RESTARTS=${LINCHECK_RESTARTS:-20}" \
  --test-env "BERTH_TEST_TIMEOUT_S=3600"
