#!/usr/bin/env bash
# Stop the workers started by start-prefect-worker.sh, then the server started
# by start-prefect.sh (same environment). PURGE=1 also deletes the DB.
set -uo pipefail
. "$(dirname "$0")/lib.sh"
RUN="${POSTTRAIN_PREFECT_DIR:-$SERVICES_DIR/prefect}"
"$(dirname "$0")/stop-prefect-worker.sh"
stop_pidfile "prefect server" "$RUN/server.pid" prefect 150
rm -f "$RUN/port" "$RUN/db"
if [ "${PURGE:-0}" = 1 ]; then rm -rf "$RUN" && echo "purged $RUN"; fi
exit 0
