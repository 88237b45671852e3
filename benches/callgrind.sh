#!/usr/bin/env bash
# Instructions an `ax server` spends per submit, counted by valgrind's callgrind (for
# machines without hardware counters): the server alone under callgrind for SECS seconds,
# a Python client in another process submitting N tasks by request one after another
# (queue `q`, capacities 100,000, no worker). Run it with N=0 and N=16000 and take
# (Ir(16000) - Ir(0)) / 16000 (docs/PERFORMANCE.md, "What flow control costs a queue that
# does not use it"). Needs valgrind, `./dev nats` and the Python package in .tools/pydev.
#
#   benches/callgrind.sh target/release/ax head 0 70
#   benches/callgrind.sh target/release/ax head 16000 70
#
# Prints the run's instruction total; the profile is left in /tmp/cg.<tag>.out
# (callgrind_annotate --inclusive=yes /tmp/cg.<tag>.out).
set -u
cd "$(dirname "$0")/.."
AX=${1:?usage: benches/callgrind.sh <ax binary> <tag> <submits> <seconds>}
TAG=${2:?tag}; N=${3:?submits}; SECS=${4:-70}
NATS_BIN=${AX_NATS_SERVER:-.tools/nats/bin/nats-server}
PY=${AX_PY:-.tools/pydev/bin/python}
PORT=$((20000 + RANDOM % 20000))
STORE=$(mktemp -d)
"$NATS_BIN" -js -p "$PORT" -sd "$STORE" >/dev/null 2>&1 &
NATS=$!
sleep 1
export NATS_URL=nats://127.0.0.1:$PORT
"$AX" streams apply --queue q --capacity 100000,100000,100000 >/dev/null 2>&1 || echo "streams apply failed"
RUST_LOG=error valgrind --tool=callgrind --callgrind-out-file="/tmp/cg.$TAG.out" \
  "$AX" server --queue q --metrics-addr off >"/tmp/cg.$TAG.log" 2>&1 &
SRV=$!
START=$(date +%s)
AX_URL=$NATS_URL "$PY" - "$N" <<'PY'
import sys, time
import ax_scheduler as ax
n = int(sys.argv[1])
deadline = time.time() + 120
while True:  # the server starts slowly under valgrind
    try:
        c = ax.Client()
        c.submit_request("q", {"name": "warm", "payload": 0})
        break
    except (ax.Unavailable, ax.NotFound) as e:
        if time.time() > deadline:
            raise
        print(f"waiting for the server: {e}", file=sys.stderr)
        time.sleep(1)
t0 = time.time()
for i in range(n):
    c.submit_request("q", {"name": "t", "payload": i})
print(f"{n} submits in {time.time() - t0:.1f} s", flush=True)
PY
while [ $(( $(date +%s) - START )) -lt "$SECS" ]; do sleep 1; done
kill -TERM "$SRV"; wait "$SRV"
kill "$NATS"; rm -rf "$STORE"
grep -h "^totals" "/tmp/cg.$TAG.out"
