#!/usr/bin/env bash
# The whole test suite: every crate's tests, the TypeScript client's and the dashboard's
# node tests, the failpoint crash tests, then 200 seeds of the simulator.
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
# The TypeScript client's tests and the dashboard's browser test need Node.js (with npm)
# and Debian's Chromium (driven by playwright-core, which downloads no browser).
missing=()
command -v node >/dev/null && command -v npm >/dev/null || missing+=(nodejs npm)
[ -x "${BERTH_CHROMIUM:-/usr/bin/chromium}" ] || missing+=(chromium)
if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; } ||
    echo "could not install ${missing[*]}: the node tests will say so" >&2
fi
# The OpenAPI document is checked by a real validator (openapi-spec-validator, pinned
# in scripts/openapi-validator.txt), installed from PyPI into target/ (no venv needed,
# nothing system-wide).
validator=$PWD/target/openapi-validator
if [ ! -d "$validator/openapi_spec_validator" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --target "$validator" \
    -r scripts/openapi-validator.txt ||
    echo "could not install openapi-spec-validator: the OpenAPI validation test will say so" >&2
fi
export BERTH_OPENAPI_VALIDATOR=$validator
# Fleet mode's tests need a real PostgreSQL server: pg_virtualenv (Debian's
# postgresql-common) makes a throwaway cluster, runs the command with PGHOST, PGPORT,
# PGUSER and PGPASSWORD set, and drops the cluster after. A server the caller already
# names in PGHOST is used as it is.
if ! command -v pg_virtualenv >/dev/null || ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql postgresql-common >/dev/null; } ||
      echo "could not install postgresql: the fleet tests will say so" >&2
  fi
fi
with_pg() {
  if [ -n "${PGHOST:-}" ] || ! command -v pg_virtualenv >/dev/null; then
    "$@"
  else
    pg_virtualenv "$@"
  fi
}
with_pg cargo test --workspace --locked
# Both node suites start the binary cargo just built, each on a free port with a fresh
# state dir. Packages come from the lockfiles only (npm ci); no generator runs.
if command -v node >/dev/null && command -v npm >/dev/null &&
  [ -x "${BERTH_CHROMIUM:-/usr/bin/chromium}" ]; then
  export BERTH_BIN="$PWD/target/debug/berth"
  (cd clients/typescript && npm ci --no-audit --no-fund --loglevel=error && npm test)
  (cd tests/web && npm ci --no-audit --no-fund --loglevel=error && npm test)
elif [ -n "${CI:-}" ] || [ -n "${BERTH_REQUIRE_ROOT:-}" ]; then
  echo "node, npm or chromium is missing: the TypeScript and browser tests cannot run" >&2
  exit 1
else
  echo "::warning:: node, npm or chromium is missing: the TypeScript and browser tests did not run" >&2
fi
# The Python client's suite (pytest) against the binary cargo just built; httpx and
# pytest come from PyPI, pinned in clients/python/requirements-test.txt, into target/.
pydeps=$PWD/target/python-deps
if [ ! -d "$pydeps/httpx" ] || [ ! -d "$pydeps/_pytest" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --target "$pydeps" \
    -r clients/python/requirements-test.txt
fi
(cd clients/python && BERTH_BIN="$PWD/../../target/debug/berth" PYTHONPATH="$pydeps:src" \
  python3 -m pytest -q -p no:cacheprovider tests)
# The crash tests need the daemon built with its failpoints (a cargo feature).
cargo test --locked -p berth --features failpoints --test failpoints
cargo run --locked -q -p berth-sim -- --seeds "${BERTH_SIM_SEEDS:-200}"
