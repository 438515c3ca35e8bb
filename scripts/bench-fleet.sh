#!/usr/bin/env bash
# Fleet mode's benchmark on a throwaway PostgreSQL server:
#
#   scripts/bench-fleet.sh [HOSTS] [CLIENTS] [SECONDS]
#
# pg_virtualenv (Debian's postgresql-common; installed here if missing and run as
# root) starts a cluster (with fsync on), runs `berth-bench fleet` against it with PGHOST, PGPORT,
# PGUSER and PGPASSWORD set, and drops it. One JSON line: lifecycles/s fleet-wide with
# and without a budget token, the single-host SQLite figure and pgbench's
# insert-then-delete lifecycle on the same server, all from this one run.
set -euo pipefail
cd "$(dirname "$0")/.."
hosts=${1:-3} clients=${2:-64} seconds=${3:-10}
if ! command -v pg_virtualenv >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql postgresql-common >/dev/null
fi
cargo build --release --locked -q -p berth-bench
# fsync on: pg_virtualenv's clusters skip it by default, and the figure beside berth's
# (which fsyncs every commit) must pay for durability too.
exec pg_virtualenv -o fsync=on target/release/berth-bench fleet --hosts "$hosts" --clients "$clients" --seconds "$seconds"
