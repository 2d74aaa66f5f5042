#!/usr/bin/env bash
# Start a Prefect 3 server (SQLite) on loopback with its own PREFECT_HOME.
# Idempotent. Prints one "PREFECT READY <api url> ..." line once /api/health
# answers true.
#
#   PREFECT_PORT           (default 4200) the API and the UI (its /ui-settings names this port)
#   PREFECT_UI=0           no UI (starts ~2 s faster)
#   POSTTRAIN_PREFECT_DIR  (default $POSTTRAIN_SERVICES_DIR/prefect) home (prefect.db),
#                          pid, log; workers/ for start-prefect-worker.sh
#
# Clients then need: export PREFECT_API_URL=http://127.0.0.1:$PREFECT_PORT/api
# A new DB costs 10-15 s of migrations; an existing one starts in 4-6 s.
# Stop with stop-prefect.sh (stops the workers too).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
RUN="${POSTTRAIN_PREFECT_DIR:-$SERVICES_DIR/prefect}"
PORT="${PREFECT_PORT:-4200}"
API="http://127.0.0.1:$PORT/api"
PIDF="$RUN/server.pid"
t0="$(now)"
mkdir -p "$RUN/home"
healthy() {
  "$PYTHON" -c 'import sys, urllib.request as u; sys.exit(0 if b"true" in u.urlopen(sys.argv[1], timeout=2).read() else 1)' \
    "$API/health" 2>/dev/null
}

if pid_alive "$PIDF" prefect; then
  running_port="$(cat "$RUN/port" 2>/dev/null || echo '?')"
  if [ "$running_port" != "$PORT" ]; then
    echo "Prefect server from $RUN already runs on port $running_port (pid $(cat "$PIDF")); stop-prefect.sh first" >&2
    exit 1
  fi
  # it may still be migrating a new DB: fall through to the health wait
  echo "Prefect server already running (pid $(cat "$PIDF"))" >&2
else
  if port_open "$PORT"; then echo "port $PORT is taken by another process" >&2; exit 1; fi
  [ -x "$BIN_DIR/prefect" ] || { echo "$BIN_DIR/prefect not found (set POSTTRAIN_BIN_DIR)" >&2; exit 1; }
  echo "$PORT" > "$RUN/port"
  ui=true; [ "${PREFECT_UI:-1}" = 0 ] && ui=false
  # analytics off: no outside network, and it would only log failures. The UI asks
  # /ui-settings for its API URL, which Prefect derives from PREFECT_SERVER_API_PORT,
  # not from --port: without these two the UI of a server on another port calls :4200.
  setsid env PREFECT_HOME="$RUN/home" PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_UI_ENABLED="$ui" \
    PREFECT_SERVER_API_HOST=127.0.0.1 PREFECT_SERVER_API_PORT="$PORT" PREFECT_SERVER_UI_API_URL="$API" \
    "$BIN_DIR/prefect" server start --host 127.0.0.1 --port "$PORT" \
    </dev/null >>"$RUN/server.log" 2>&1 &
  echo $! > "$PIDF"
fi

for _ in $(seq 900); do
  healthy && break
  pid_alive "$PIDF" prefect || { echo "Prefect server exited; see $RUN/server.log" >&2; rm -f "$PIDF"; exit 1; }
  sleep 0.1
done
healthy || { echo "Prefect server not healthy after 90 s; see $RUN/server.log" >&2; exit 1; }
echo "PREFECT READY $API (pid $(cat "$PIDF")) in $(since "$t0")s"
