#!/usr/bin/env bash
# The whole test suite: every crate's tests, then 200 seeds of the simulator.
# This is the README's test command; .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
# The durability test runs the daemon under strace (crates/berth/tests/durability.rs).
if ! command -v strace >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && apt-get install -y -qq strace >/dev/null; } ||
    echo "could not install strace: the durability test will say so" >&2
fi
# The runtime tests launch real servers (`python3 -m http.server`, crates/berth/tests/runtime.rs).
if ! command -v python3 >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && apt-get install -y -qq python3 >/dev/null; } ||
    echo "could not install python3: the runtime tests will say so" >&2
fi
cargo test --workspace --locked
# The crash tests need the daemon built with its failpoints (a cargo feature).
cargo test --locked -p berth --features failpoints --test failpoints
cargo run --locked -q -p berth-sim -- --seeds "${BERTH_SIM_SEEDS:-200}"
