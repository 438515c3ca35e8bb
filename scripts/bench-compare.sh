#!/usr/bin/env bash
# Compares `berth-bench http` of this checkout with an older commit's, on this machine.
#
#   scripts/bench-compare.sh REV [ROUNDS] [CLIENTS] [SUBSCRIBERS]
#
# One run's figure moves by ±15% on a shared 2-core machine, so a single before/after
# pair proves nothing. This prints two measures:
#   - alternated: ROUNDS rounds of (REV, this checkout, this checkout with SUBSCRIBERS
#     SSE readers), one at a time, and the median of each (alternating spreads the
#     machine's slow and fast spells over all three);
#     Also the median over rounds of each round's (with SUBSCRIBERS) / REV: a round's
#     runs are minutes apart at most, so this ratio sees less of the machine's drift
#     than the ratio of the medians (one run's figure moved 6,700 -> 13,000 in an hour).
#   - paired: ROUNDS runs of REV and this checkout (with its SSE readers) at the same
#     time, the ratio of their rates (both see the same machine; each has about one
#     core, so this weighs CPU cost more than latency).
# REV's bench is built in a worktree under target/ (REV must have `berth-bench http`;
# `--subscribers` is passed to this checkout only).
set -euo pipefail
rev=${1:?usage: bench-compare.sh REV [ROUNDS] [CLIENTS] [SUBSCRIBERS]}
rounds=${2:-8}
clients=${3:-64}
subs=${4:-8}
secs=${BENCH_SECONDS:-10}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
work=$root/target/bench-compare
mkdir -p "$work"
if [ ! -x "$work/before" ] || [ "$(cat "$work/before.rev" 2>/dev/null)" != "$(git rev-parse "$rev")" ]; then
    rm -rf "$work/tree"
    git worktree prune
    git worktree add -f --detach "$work/tree" "$rev" >/dev/null
    # A target dir of its own: the two trees' crates share names and paths would collide.
    (cd "$work/tree" && CARGO_TARGET_DIR=$work/target cargo build --release -q -p berth-bench)
    cp "$work/target/release/berth-bench" "$work/before"
    git rev-parse "$rev" >"$work/before.rev"
    git worktree remove --force "$work/tree"
fi
cargo build --release -q -p berth-bench
cp target/release/berth-bench "$work/after"

rate() { grep -o '"lifecycles_per_s":[0-9.]*' "$1" | head -1 | cut -d: -f2; }
run() { "$@" >"$work/out" 2>/dev/null; rate "$work/out"; }
median() { sort -n | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : int((v[NR/2]+v[NR/2+1])/2)}'; }

: >"$work/before.txt"; : >"$work/after.txt"; : >"$work/subs.txt"; : >"$work/ratio.txt"; : >"$work/round.txt"
for i in $(seq 1 "$rounds"); do
    b=$(run "$work/before" http --clients "$clients" --seconds "$secs")
    a=$(run "$work/after" http --clients "$clients" --seconds "$secs")
    s=$(run "$work/after" http --clients "$clients" --seconds "$secs" --subscribers "$subs")
    echo "$b" >>"$work/before.txt"; echo "$a" >>"$work/after.txt"; echo "$s" >>"$work/subs.txt"
    awk -v a="$s" -v b="$b" 'BEGIN {printf "%d\n", 1000 * a / b}' >>"$work/round.txt"
    echo "round $i: before=$b after=$a after_with_${subs}_subscribers=$s"
done
for i in $(seq 1 "$rounds"); do
    "$work/before" http --clients "$clients" --seconds "$secs" >"$work/pb" 2>/dev/null &
    pb=$!
    "$work/after" http --clients "$clients" --seconds "$secs" --subscribers "$subs" >"$work/pa" 2>/dev/null &
    pa=$!
    wait "$pb" "$pa"
    awk -v a="$(rate "$work/pa")" -v b="$(rate "$work/pb")" 'BEGIN {printf "%.3f\n", a / b}' >>"$work/ratio.txt"
    echo "paired $i: after/before=$(tail -1 "$work/ratio.txt")"
done
mb=$(median <"$work/before.txt"); ma=$(median <"$work/after.txt"); ms=$(median <"$work/subs.txt")
mr=$(awk '{print $1 * 1000}' "$work/ratio.txt" | median)
mo=$(median <"$work/round.txt")
printf '{"clients":%s,"rounds":%s,"before_rev":"%s","before_median":%s,"after_median":%s,"after_with_subscribers_median":%s,"subscribers":%s,"after_vs_before":%.3f,"with_subscribers_vs_before":%.3f,"round_ratio_with_subscribers_median":%.3f,"paired_with_subscribers_vs_before_median":%.3f}\n' \
    "$clients" "$rounds" "$(cat "$work/before.rev")" "$mb" "$ma" "$ms" "$subs" \
    "$(awk -v a="$ma" -v b="$mb" 'BEGIN {print a / b}')" \
    "$(awk -v a="$ms" -v b="$mb" 'BEGIN {print a / b}')" \
    "$(awk -v r="$mo" 'BEGIN {print r / 1000}')" \
    "$(awk -v r="$mr" 'BEGIN {print r / 1000}')"
