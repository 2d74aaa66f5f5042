#!/usr/bin/env bash
# Start a Prefect 3 server on loopback with its own PREFECT_HOME: embedded SQLite by default,
# or PostgreSQL. Idempotent. Prints one "PREFECT READY <api url> ..." line once /api/health
# answers true.
#
#   PREFECT_PORT           (default 4200) the API and the UI (its /ui-settings names this port)
#   PREFECT_UI=0           no UI (starts ~2 s faster)
#   POSTTRAIN_PREFECT_DIR  (default $POSTTRAIN_SERVICES_DIR/prefect) home (prefect.db),
#                          pid, log; workers/ for start-prefect-worker.sh
#   POSTTRAIN_PREFECT_DB   sqlite (default) | postgres (the server of start-postgres.sh: its
#                          URL from $POSTTRAIN_POSTGRES_DIR/url; run start-postgres.sh first) |
#                          a postgresql+asyncpg://user:password@host:port/db URL.
#                          PREFECT_API_DATABASE_CONNECTION_URL, when set, is used as it is.
#   PREFECT_SERVER_SERVICES_{TASK_RUN_RECORDER,EVENT_PERSISTER}_{BATCH_SIZE,FLUSH_INTERVAL}
#                          default here 1000 and 1 s (Prefect's: batches of 1 and 20, 5 s): see below
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

DB_URL="${PREFECT_API_DATABASE_CONNECTION_URL:-${PREFECT_SERVER_DATABASE_CONNECTION_URL:-}}"
case "${POSTTRAIN_PREFECT_DB:-sqlite}" in
  sqlite) ;;
  postgres)
    PG_RUN="${POSTTRAIN_POSTGRES_DIR:-$SERVICES_DIR/postgres}"
    [ -s "$PG_RUN/url" ] || { echo "no $PG_RUN/url: start-postgres.sh first" >&2; exit 1; }
    DB_URL="$(cat "$PG_RUN/url")" ;;
  postgresql*) DB_URL="$POSTTRAIN_PREFECT_DB" ;;
  *) echo "POSTTRAIN_PREFECT_DB: sqlite, postgres or a postgresql+asyncpg:// URL" >&2; exit 1 ;;
esac
if [ -z "$DB_URL" ]; then DB_URL="sqlite+aiosqlite:///$RUN/home/prefect.db"; fi
DB_KIND="${DB_URL%%:*}"; DB_KIND="${DB_KIND%%+*}"
# the URL without its password, to compare with a running server's and to print
DB_SHOWN="$(printf '%s' "$DB_URL" | sed -E 's#//([^:/@]+):[^@]*@#//\1:***@#')"
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
  running_db="$(cat "$RUN/db" 2>/dev/null || echo "$DB_SHOWN")"
  if [ "$running_db" != "$DB_SHOWN" ]; then
    echo "Prefect server from $RUN already runs on $running_db, not $DB_SHOWN; stop-prefect.sh first" >&2
    exit 1
  fi
  # it may still be migrating a new DB: fall through to the health wait
  echo "Prefect server already running (pid $(cat "$PIDF"))" >&2
else
  if port_open "$PORT"; then echo "port $PORT is taken by another process" >&2; exit 1; fi
  [ -x "$BIN_DIR/prefect" ] || { echo "$BIN_DIR/prefect not found (set POSTTRAIN_BIN_DIR)" >&2; exit 1; }
  echo "$PORT" > "$RUN/port"
  echo "$DB_SHOWN" > "$RUN/db"
  ui=true; [ "${PREFECT_UI:-1}" = 0 ] && ui=false
  # analytics off: no outside network, and it would only log failures. The UI asks
  # /ui-settings for its API URL, which Prefect derives from PREFECT_SERVER_API_PORT,
  # not from --port: without these two the UI of a server on another port calls :4200.
  # The server's task-run recorder commits every task-run event on its own (batch size 1), and its
  # event persister every 20 events: on SQLite each such commit can fail a concurrent API
  # transaction that read before writing (503, and the client backs off 2 s). Batched, they
  # commit once a second; task-run states reach the API up to a second later. Set them in the
  # environment to override.
  setsid env PREFECT_HOME="$RUN/home" \
    PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE="${PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE:-1000}" \
    PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL="${PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL:-1}" \
    PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE="${PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE:-1000}" \
    PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL="${PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL:-1}" \
    PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_UI_ENABLED="$ui" \
    PREFECT_SERVER_API_HOST=127.0.0.1 PREFECT_SERVER_API_PORT="$PORT" PREFECT_SERVER_UI_API_URL="$API" \
    PREFECT_API_DATABASE_CONNECTION_URL="$DB_URL" \
    "$BIN_DIR/prefect" server start --host 127.0.0.1 --port "$PORT" \
    </dev/null >>"$RUN/server.log" 2>&1 &
  echo $! > "$PIDF"
fi

for _ in $(seq 900); do
  healthy && break
  still_starting "$PIDF" || { echo "Prefect server exited; see $RUN/server.log" >&2; rm -f "$PIDF"; exit 1; }
  sleep 0.1
done
healthy || { echo "Prefect server not healthy after 90 s; see $RUN/server.log" >&2; exit 1; }
echo "PREFECT READY $API (pid $(cat "$PIDF"), $DB_KIND) in $(since "$t0")s"
