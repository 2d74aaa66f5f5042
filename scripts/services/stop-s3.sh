#!/usr/bin/env bash
# Stop the SeaweedFS started by start-s3.sh (by its recorded pid; same environment).
#   PURGE=1  also delete its folder (all objects).
set -uo pipefail
. "$(dirname "$0")/lib.sh"
RUN="${POSTTRAIN_S3_DIR:-$SERVICES_DIR/s3}"
stop_pidfile seaweedfs "$RUN/weed.pid" weed 150
# its gRPC unix sockets live in /tmp (named by port); most, not all, go on exit
for p in $(cat "$RUN/ports" 2>/dev/null); do rm -f /tmp/seaweedfs-*-"$p".sock; done
rm -f "$RUN/port" "$RUN/ports" "$RUN/s3.sock" "$RUN/filer.sock"
if [ "${PURGE:-0}" = 1 ]; then rm -rf "$RUN" && echo "purged $RUN"; fi
exit 0
