#!/usr/bin/env bash
# The Python benchmark (docs/PERFORMANCE.md, "Python"): ax's Python worker against
# Celery 5 and Dramatiq 2 on Redis, and against ax's Rust worker, same machine, one run.
#   ./dev bench python [bench.py options]      e.g. --systems ax,dramatiq --workloads drain
# Installs what it needs: redis-server (Debian), the pinned peers and ax-scheduler (a
# release build of ./python) into .tools/pybench, the release `ax` binary. Redis runs
# without persistence, nats-server with its defaults (see the doc for both settings).
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
REDIS_PORT=$(free_port); NATS_PORT=$(free_port)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
redis-server --port "$REDIS_PORT" --save "" --appendonly no --dir "$WORK" >"$WORK/redis.log" 2>&1 & pids+=($!)
"$NATS_BIN" -js -sd "$WORK/js" -a 127.0.0.1 -p "$NATS_PORT" >"$WORK/nats.log" 2>&1 & pids+=($!)
"$ROOT/target/release/ax" --url "nats://127.0.0.1:$NATS_PORT" server --queue bench --capacity 100000,100000,100000 \
  --metrics-addr off >"$WORK/ax-server.log" 2>&1 & pids+=($!)
sleep 2
echo "redis $(redis-server --version | cut -d' ' -f3), $("$NATS_BIN" --version), $("$VENV/bin/python" -c 'import celery, dramatiq; print("celery", celery.__version__, "dramatiq", dramatiq.__version__)'), $(nproc) cores, $(date -u +%FT%TZ)"
"$VENV/bin/python" "$HERE/bench.py" --nats "nats://127.0.0.1:$NATS_PORT" --redis "redis://127.0.0.1:$REDIS_PORT/0" \
  --ax-bin "$ROOT/target/release/ax" "$@"
