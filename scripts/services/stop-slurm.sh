#!/usr/bin/env bash
# Stop what start-slurm.sh started, by the pids it recorded (munged only when
# that script started it). Cancels all jobs first. Same env as start-slurm.sh.
#
#   PURGE=1  also delete the folder: state AND accounting DB together. Deleting
#            only the state restarts job ids at 1 while old sacct rows remain.
set -uo pipefail
. "$(dirname "$0")/lib.sh"
. "$(dirname "$0")/slurm-env.sh"
if pid_alive "$RUN/slurmctld.pid" slurmctld; then
  timeout 15 scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
fi
for f in "$RUN"/slurmd.pid "$RUN"/slurmd.*.pid; do   # slurmd.pid: a single-node start of old
  [ -e "$f" ] && stop_pidfile "$(basename "$f" .pid)" "$f" slurmd
done
stop_pidfile slurmctld "$RUN/slurmctld.pid" slurmctld
stop_pidfile slurmdbd  "$RUN/slurmdbd.pid"  slurmdbd
stop_pidfile mariadbd  "$RUN/mariadbd.pid"  mariadbd 300
stop_pidfile munged    "$RUN/munged.pid"    munged
if [ "${PURGE:-0}" = 1 ]; then
  rm -rf "$RUN" && echo "purged $RUN"
fi
exit 0
