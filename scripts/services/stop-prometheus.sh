#!/usr/bin/env bash
# Stop the Prometheus started by start-prometheus.sh (by its recorded pid; same environment).
#   PURGE=1  also delete its folder (the TSDB, targets and token files).
set -uo pipefail
. "$(dirname "$0")/lib.sh"
RUN="${POSTTRAIN_PROMETHEUS_DIR:-$SERVICES_DIR/prometheus}"
stop_pidfile prometheus "$RUN/prometheus.pid" prometheus 100
rm -f "$RUN/port"
if [ "${PURGE:-0}" = 1 ]; then rm -rf "$RUN" && echo "purged $RUN"; fi
exit 0
