#!/usr/bin/env bash
# Compares the server and worker of another build with this one's: the deployed bench
# (`./dev bench`) run alternately with `AX_BENCH_AX_BIN=<other ax binary>` and without,
# the same producer and harness, so the hour's drift falls on both alike
# (docs/PERFORMANCE.md, "What flow control costs a queue that does not use it").
#
#   git worktree add /tmp/base <commit>
#   (cd /tmp/base && CARGO_TARGET_DIR=/tmp/base-target cargo build --release --bin ax)
#   AX_BENCH_TASKS=150000 benches/compare.sh /tmp/base-target/release/ax 8
#
# Prints each run's lines under `=== run <i> base|head <time>`; nothing is asserted.
set -euo pipefail
other=${1:?usage: benches/compare.sh <other ax binary> [pairs]}
pairs=${2:-8}
cd "$(dirname "$0")/.."
cargo bench --bench deployed --no-run 2>/dev/null # built once, before the first run
for i in $(seq 1 "$pairs"); do
  for which in base head; do
    echo "=== run $i $which $(date -u +%H:%M:%S)"
    if [ "$which" = base ]; then
      AX_BENCH_AX_BIN="$other" cargo bench --bench deployed 2>/dev/null
    else
      cargo bench --bench deployed 2>/dev/null
    fi
  done
done
