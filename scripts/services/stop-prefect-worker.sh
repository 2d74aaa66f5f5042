#!/usr/bin/env bash
# Stop Prefect workers: by pool (pid files of start-prefect-worker.sh), by pid,
# or, with no argument, every worker recorded there.
#
#   usage: stop-prefect-worker.sh [POOL|PID ...]
#
# A worker turns SIGTERM into SIGINT for itself and does not always exit on it
# (one was still alive 10 min later), so this sends TERM, waits 3 s, sends TERM
# again (which makes it SIGKILL itself), then KILL. Scripts can source lib.sh
# and call stop_prefect_worker PID for the same.
set -uo pipefail
. "$(dirname "$0")/lib.sh"
RUN="${POSTTRAIN_PREFECT_DIR:-$SERVICES_DIR/prefect}/workers"
targets=("$@")
if [ ${#targets[@]} = 0 ]; then
  for f in "$RUN"/*.pid; do [ -e "$f" ] && targets+=("$(basename "$f" .pid)"); done
fi
for t in "${targets[@]}"; do
  if [[ "$t" =~ ^[0-9]+$ ]]; then
    stop_prefect_worker "$t" && echo "stopped prefect worker (pid $t)"
  elif [ -f "$RUN/$t.pid" ]; then
    if pid_alive "$RUN/$t.pid" prefect; then
      pid="$(cat "$RUN/$t.pid")"
      stop_prefect_worker "$pid" && echo "stopped prefect worker $t (pid $pid)"
    fi
    rm -f "$RUN/$t.pid"
  fi
done
exit 0
