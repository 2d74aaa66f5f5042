#!/usr/bin/env bash
# Start a Prefect worker for POOL against the server of start-prefect.sh.
# Idempotent per pool. Prints one "PREFECT WORKER READY ..." line.
#
#   usage: start-prefect-worker.sh POOL [TYPE]     (TYPE default: process; a
#          missing pool is created by the worker)
#   PREFECT_API_URL               (default http://127.0.0.1:${PREFECT_PORT:-4200}/api)
#   PREFECT_WORKER_QUERY_SECONDS  (default 1 here; Prefect's own default is 10 s)
#   POSTTRAIN_PREFECT_DIR         workers/<pool>.pid and .log live below it
#
# Stop with stop-prefect-worker.sh POOL (or stop-prefect.sh, which stops all).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[ $# -ge 1 ] || { echo "usage: $0 POOL [TYPE]" >&2; exit 2; }
POOL="$1"; TYPE="${2:-process}"
case "$POOL" in *[!A-Za-z0-9._-]*|'') echo "pool name '$POOL': use letters, digits, . _ -" >&2; exit 2 ;; esac
RUN="${POSTTRAIN_PREFECT_DIR:-$SERVICES_DIR/prefect}/workers"
PIDF="$RUN/$POOL.pid"; LOG="$RUN/$POOL.log"
t0="$(now)"
mkdir -p "$RUN"
if pid_alive "$PIDF" prefect; then
  echo "PREFECT WORKER READY pool=$POOL (already running, pid $(cat "$PIDF"))"; exit 0
fi
: >"$LOG"
setsid env PREFECT_API_URL="${PREFECT_API_URL:-http://127.0.0.1:${PREFECT_PORT:-4200}/api}" \
  PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-1}" \
  PREFECT_SERVER_ANALYTICS_ENABLED=false \
  "$BIN_DIR/prefect" worker start --pool "$POOL" --type "$TYPE" </dev/null >>"$LOG" 2>&1 &
echo $! > "$PIDF"
for _ in $(seq 600); do
  grep -q "started" "$LOG" && break
  still_starting "$PIDF" || { echo "worker exited; see $LOG:" >&2; tail -5 "$LOG" >&2; rm -f "$PIDF"; exit 1; }
  sleep 0.1
done
grep -q "started" "$LOG" || { echo "worker did not start in 60 s; see $LOG" >&2; exit 1; }
echo "PREFECT WORKER READY pool=$POOL type=$TYPE (pid $(cat "$PIDF")) in $(since "$t0")s"
