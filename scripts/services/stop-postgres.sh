#!/usr/bin/env bash
# Stop the PostgreSQL server started by start-postgres.sh (same environment): fast shutdown
# (open sessions are ended). PURGE=1 also deletes its data folder.
set -uo pipefail
. "$(dirname "$0")/lib.sh"
RUN="${POSTTRAIN_POSTGRES_DIR:-$SERVICES_DIR/postgres}"
DATA="$RUN/data"
if [ -s "$DATA/postmaster.pid" ]; then
  pid="$(head -1 "$DATA/postmaster.pid")"
  if running "$pid" && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q postgres; then
    # SIGINT is the postmaster's "fast" shutdown: the same as pg_ctl stop -m fast, without
    # needing the owner's uid.
    kill -INT "$pid"
    if ! wait_gone "$pid" 300; then
      echo "PostgreSQL ($pid) still running after 30 s; sending SIGQUIT" >&2
      kill -QUIT "$pid" 2>/dev/null; wait_gone "$pid" 50 || true
    fi
    echo "stopped postgres (pid $pid)"
  fi
fi
rm -f "$RUN/url"
if [ "${PURGE:-0}" = 1 ]; then rm -rf "$RUN" && echo "purged $RUN"; fi
exit 0
