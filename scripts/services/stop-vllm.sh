#!/usr/bin/env bash
# Stop the vLLM server started by start-vllm.sh (same environment): SIGTERM to its
# process group (API server, EngineCore, worker), SIGKILL after 20 s, then wait
# until no process of the group is left.
set -uo pipefail
. "$(dirname "$0")/lib.sh"
RUN="${POSTTRAIN_VLLM_DIR:-$SERVICES_DIR/vllm}"
PIDF="$RUN/vllm.pid"

# group_pids PGID: live (non-zombie) processes of the group
group_pids() { ps -e -o pid=,pgid=,stat= | awk -v g="$1" '$2 == g && $3 !~ /^Z/ {print $1}'; }

# vllm_group_pids PGID: live (non-zombie) vLLM processes of the group (by command line,
# so a stale pid file never leads to someone else's processes)
vllm_group_pids() {
  local pid
  for pid in $(group_pids "$1"); do
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qi vllm && echo "$pid"
  done
}

if [ -s "$PIDF" ]; then
  pgid="$(cat "$PIDF")"
  stop_pidfile vllm "$PIDF" vllm.entrypoints 200
  # The leader may exit before its children (or have died alone, e.g. after an
  # engine failure): wait for, then kill, what is left of its group.
  for _ in $(seq 100); do [ -z "$(vllm_group_pids "$pgid")" ] && break; sleep 0.1; done
  left="$(vllm_group_pids "$pgid")"
  if [ -n "$left" ]; then
    echo "vLLM processes left in group $pgid: $(echo $left); killing them" >&2
    kill -KILL $left 2>/dev/null
    for _ in $(seq 50); do [ -z "$(vllm_group_pids "$pgid")" ] && break; sleep 0.1; done
    [ -z "$(vllm_group_pids "$pgid")" ] || { echo "vLLM group $pgid still has processes" >&2; exit 1; }
    echo "stopped the rest of vLLM's group $pgid"
  fi
fi
rm -f "$PIDF" "$RUN/serving"
exit 0
