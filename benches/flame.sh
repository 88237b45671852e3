#!/usr/bin/env bash
# Flame graphs of the e2e bench's run (b): one of the ax process (producers, ax server and
# worker in one process) and one of nats-server, sampled together with `perf record -a`.
#
#   benches/flame.sh [OUT_DIR]      # default docs/flame; needs perf and inferno
#                                   # (cargo install inferno)
#
# Settings: AX_BENCH_TASKS (default 50000), FLAME_FREQ (default 99 Hz). The delayed-task
# run (c) is cut to 1 task so the profile is (a) raw, (b) and (b2). Run through ./dev so
# the pinned nats-server is used: `./dev flame`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/flame}
freq=${FLAME_FREQ:-99}
mkdir -p "$out"
command -v perf >/dev/null || { echo "flame.sh: perf is not installed" >&2; exit 1; }
command -v inferno-flamegraph >/dev/null || { echo "flame.sh: cargo install inferno" >&2; exit 1; }
echo "building the e2e bench (release) ..." >&2
bin=$(cargo bench --bench e2e --no-run --message-format=json 2>/dev/null \
  | sed -n 's/.*"executable":"\([^"]*e2e-[^"]*\)".*/\1/p' | tail -1)
[ -x "$bin" ] || { echo "flame.sh: no e2e bench binary" >&2; exit 1; }
data=$(mktemp -d)
trap 'rm -rf "$data"' EXIT
echo "profiling $bin at $freq Hz (every process; about a minute) ..." >&2
AX_BENCH_DELAYED=1 perf record -q -a -F "$freq" -m 1024 --call-graph dwarf,8192 -o "$data/perf.data" \
  -- "$bin" --bench >"$out/bench-output.txt" 2>&1
perf script -i "$data/perf.data" 2>/dev/null | inferno-collapse-perf >"$data/all.folded"
# Each stack's first frame is its thread's name: nats-server's threads are named after it;
# the bench's are its binary's name and tokio's workers (everything else: the kernel's
# idle loop, perf itself).
echo "samples by thread name:" >&2
awk '{split($1, f, ";"); n[f[1]] += $NF} END {for (k in n) printf "  %.0f %s\n", n[k], k}' \
  "$data/all.folded" | sort -rn | head -8 >&2
grep '^nats-server' "$data/all.folded" >"$data/nats.folded" || true
grep -vE '^(nats-server|swapper|perf|perf-exec);' "$data/all.folded" >"$data/ax.folded" || true
inferno-flamegraph --title "ax process (producers, server, worker): e2e (a)+(b)+(b2)" \
  <"$data/ax.folded" >"$out/ax.svg"
inferno-flamegraph --title "nats-server: e2e (a)+(b)+(b2)" <"$data/nats.folded" >"$out/nats-server.svg"
echo "wrote $out/ax.svg, $out/nats-server.svg, $out/bench-output.txt" >&2
