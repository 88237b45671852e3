#!/usr/bin/env bash
# The Python benchmark (docs/PERFORMANCE.md, "Python"): ax's Python worker against
# Dramatiq 2 and Celery 5 on Redis, same machine, one run: drain, one producer thread
# (ax: submit and submit_nowait), 8 producer threads, retries, delayed, CPU per task
# (bench.py's doc says what each measures).
#   ./dev bench python [bench.py options]      e.g. --systems ax,dramatiq --workloads drain,one
# Installs what it needs: redis-server (Debian), the pinned peers and ax-scheduler (a
# release build of ./python) into .tools/pybench, the release `ax` binary. Starts, each its
# own process: the peers' broker Redis, the counter Redis (the handlers' INCR, for every
# system), both without persistence; nats-server with its defaults (and its monitoring
# port, for JetStream's counts); a release `ax server` with room for 100,000 ready tasks.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
NATS_BIN=${AX_NATS_SERVER:-$("$ROOT/dev" nats)}

if ! command -v redis-server >/dev/null; then
  echo "installing redis-server (for the peers) ..." >&2
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null; }
fi
VENV="$ROOT/.tools/pybench"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
echo "installing the peers and ax-scheduler (release build) into .tools/pybench ..." >&2
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$HERE/requirements.txt" "$ROOT/python"
(cd "$ROOT" && cargo build --quiet --release --bin ax)

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
WORK=$(mktemp -d)
REDIS_PORT=$(free_port); BROKER_PORT=$(free_port); NATS_PORT=$(free_port); MON_PORT=$(free_port)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
redis-server --port "$REDIS_PORT" --save "" --appendonly no --dir "$WORK" >"$WORK/redis.log" 2>&1 & pids+=($!)
COUNTER_PID=$!
mkdir "$WORK/broker"
redis-server --port "$BROKER_PORT" --save "" --appendonly no --dir "$WORK/broker" >"$WORK/broker.log" 2>&1 & pids+=($!)
BROKER_PID=$!
"$NATS_BIN" -js -sd "$WORK/js" -a 127.0.0.1 -p "$NATS_PORT" -m "$MON_PORT" >"$WORK/nats.log" 2>&1 & pids+=($!)
NATS_PID=$!
for _ in $(seq 100); do  # the ax server starts once nats-server listens
  python3 -c "import socket; socket.create_connection(('127.0.0.1', $NATS_PORT), 0.2)" 2>/dev/null && break
  sleep 0.1
done
"$ROOT/target/release/ax" --url "nats://127.0.0.1:$NATS_PORT" server --queue bench --capacity 100000,100000,100000 \
  --metrics-addr off >"$WORK/ax-server.log" 2>&1 & pids+=($!)
AX_PID=$!
sleep 2
echo "ax $(git -C "$ROOT" rev-parse --short HEAD) ($(git -C "$ROOT" status --porcelain | wc -l) paths changed in the work tree), ax-scheduler $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("ax-scheduler"))'), python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())'), redis-py $("$VENV/bin/python" -c 'import redis; print(redis.__version__)')"
echo "redis $(redis-server --version | cut -d' ' -f3), $("$NATS_BIN" --version), $("$VENV/bin/python" -c 'import celery, dramatiq; print("celery", celery.__version__, "dramatiq", dramatiq.__version__)'), $(nproc) cores, $(date -u +%FT%TZ)"
status=0
"$VENV/bin/python" "$HERE/bench.py" --nats "nats://127.0.0.1:$NATS_PORT" --nats-monitor "http://127.0.0.1:$MON_PORT" \
  --redis "redis://127.0.0.1:$REDIS_PORT/0" --broker "redis://127.0.0.1:$BROKER_PORT/0" --counter-pid "$COUNTER_PID" \
  --peer-broker-pids "$BROKER_PID" --ax-broker-pids "$NATS_PID,$AX_PID" --ax-bin "$ROOT/target/release/ax" "$@" || status=$?
echo "ended $(date -u +%FT%TZ)"
for f in ax-server nats broker redis; do  # what the servers logged at warning or above
  n=$(grep -ciE 'error|warn|panic|\[ERR\]|\[WRN\]' "$WORK/$f.log" || true)
  [ "$n" = 0 ] || { echo "$f.log: $n lines of errors or warnings:"; grep -iE 'error|warn|panic|\[ERR\]|\[WRN\]' "$WORK/$f.log" | head -5; }
done
exit $status
