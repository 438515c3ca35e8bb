#!/usr/bin/env bash
# A real terminal (tmux) walked through what `berth run` and the CLI do for real users
# (issue 33 items 1-6): inherited descriptors, a daemon restart under a run, a lease
# lost while suspended and a wait that ran out, another user's run in a workspace of
# its own, `berth drain`, and a closed pipe. Prints the terminal's transcript.
#
#   bash scripts/terminal-tour.sh [path/to/berth]     (needs tmux and python3; the
#                                                      other-user step needs root)
set -euo pipefail
cd "$(dirname "$0")/.."
BERTH=${1:-target/debug/berth}
[ -x "$BERTH" ] || cargo build -q -p berth
command -v tmux >/dev/null || { echo "tmux is needed" >&2; exit 1; }
work=$(mktemp -d)
chmod 755 "$work"
cp "$BERTH" "$work/berth"
port=$((20000 + RANDOM % 20000))
sess="berth-tour-$$"
trap 'tmux kill-session -t "$sess" 2>/dev/null || true; pkill -f "$work/berth serve" 2>/dev/null || true; rm -rf "$work"' EXIT

tmux new-session -d -s "$sess" -x 160 -y 50 "env -i HOME=$HOME PATH=$work:/usr/bin:/bin TERM=xterm PS1='$ ' bash --norc --noprofile"
say() { tmux send-keys -t "$sess" "$1" Enter; }
# Waits until the pane shows $1 (up to 60 s); with grep's -x as $2, as a whole line
# (output, not the command typed).
wait_for() {
  for _ in $(seq 600); do
    tmux capture-pane -p -t "$sess" -S -2000 | grep -qF ${2:-} -- "$1" && return 0
    sleep 0.1
  done
  echo "never saw: $1" >&2
  tmux capture-pane -p -t "$sess" -S -2000 >&2
  exit 1
}
mark=0
step() { mark=$((mark + 1)); say "echo '--- $mark. $1'"; wait_for "--- $mark. $1"; }

say "export BERTH_URL=http://127.0.0.1:$port BERTH_STATE_DIR=$work/state"
say "berth serve --listen 127.0.0.1:$port --slots-max 4 --memory-total 8GiB --cpu-total 4 --stop-grace 30s --user-workspaces $work/users >$work/daemon.log 2>&1 &"
say "until berth status >/dev/null 2>&1; do sleep 0.2; done; echo daemon\"\"-up"
wait_for "daemon-up"

step "item 1: 10 descriptors inherited from the parent reach CMD (dash)"
say "python3 -c 'import os; fds=[os.dup(2) for _ in range(10)]; [os.set_inheritable(f, True) for f in fds]; os.execvp(\"berth\", [\"berth\", \"run\", \"--project\", \"fds\", \"--cpus\", \"0.1\", \"--\", \"sh\", \"-c\", \"ls /proc/self/fd | wc -l\"])'; echo rc=\$? fds\"\"-done"
wait_for "fds-done"

step "item 2: kill -9 the daemon under a run and restart it: the run keeps its lease"
say "berth run --project restart --run-id survivor --cpus 0.1 --ttl 6s -- sh -c 'sleep 8; echo cmd-finished' & R=\$!; sleep 1"
say "pkill -9 -f 'berth serve'; sleep 2; berth serve --listen 127.0.0.1:$port --slots-max 4 --memory-total 8GiB --cpu-total 4 --stop-grace 30s --user-workspaces $work/users >>$work/daemon.log 2>&1 &"
say "wait \$R; echo rc=\$? restart\"\"-done"
wait_for "restart-done"
say "berth runs --all | grep survivor"

step "item 3: Ctrl-Z past the ttl, fg during the broker stop grace: 75 and why"
say "berth run --project lost --run-id lost --cpus 0.1 --ttl 2s -- sh -c 'while :; do echo tick; sleep 0.5; done'"
wait_for tick -x
tmux send-keys -t "$sess" C-z
wait_for "Stopped"
sleep 4
say "fg"
wait_for "was lost"
say "echo rc=\$? lost\"\"-done"
wait_for "lost-done"
step "item 3: a wait that runs out says what it waited on"
say "berth acquire --project holder --singleton db --cpus 0.1 --ttl 10m >/dev/null"
say "berth run --project late --singleton db --cpus 0.1 --wait 2s -- true; echo rc=\$? late\"\"-done"
wait_for "late-done"

if [ "$(id -u)" = 0 ]; then
  step "item 4: a token for nobody, and a run of nobody in a workspace of its own"
  say "T=\$(berth token create --scope operator --uid 65534 --expires 1h 2>/dev/null); berth token list"
  say "su nobody -s /bin/sh -c \"BERTH_URL=\$BERTH_URL BERTH_TOKEN=\$T $work/berth run --project nobodys --cpus 0.1 -- sh -c 'cd \\\$BERTH_WORKSPACE && ls -ld . && mktemp'\"; echo rc=\$? nobody\"\"-done"
  wait_for "nobody-done"
fi

step "item 5: a bare berth drain only shows; --start --reason drains; --off ends it"
say "berth drain; berth drain --start --reason tour; berth drain; berth drain --off; echo drain\"\"-done"
wait_for "drain-done"

step "item 6: a closed pipe ends every command quietly"
say "berth status | head -c 1; echo; berth runs --all | head -c 1; echo; berth threads --json | head -c 1; echo; echo pipes\"\"-done"
wait_for "pipes-done"
say "echo tour\"\"-done"
wait_for "tour-done"
tmux capture-pane -p -t "$sess" -S -2000 | sed -e '/^$/N;/^\n$/D'
