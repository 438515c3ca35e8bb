#!/usr/bin/env bash
# berth beside Redis, PostgreSQL and etcd, in one run (issue 16):
#
#   scripts/peers.sh [CLIENTS] [SECONDS]        e.g. scripts/peers.sh 1,64 10
#
# Installs the servers it is missing with apt (as root), builds berth and berth-bench
# in release, then `berth-bench peers` starts each server on loopback with a fresh data
# dir, drives the same durable fenced-lease lifecycle against it, and stops it by pid.
# One JSON line per server and client count, then berth's ratios to each peer.
set -euo pipefail
cd "$(dirname "$0")/.."
clients=${1:-1,64} seconds=${2:-10}
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v etcd >/dev/null || missing+=(etcd-server)
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || missing+=(postgresql)
if [ "${#missing[@]}" -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "missing ${missing[*]}: install them (apt) or run as root" >&2; exit 1; }
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
cargo build --release --locked -q -p berth -p berth-bench
exec target/release/berth-bench peers --clients "$clients" --seconds "$seconds"
