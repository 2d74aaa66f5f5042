# Helpers shared by the service scripts in this folder. Sourced, never run.
#
#   POSTTRAIN_SERVICES_DIR  (default /tmp/posttrain-services) one folder per service
#                           below it holds state, pid files and logs
#   POSTTRAIN_BIN_DIR       (default <repo>/.venv/bin) where python, weed and prefect live

SERVICES_DIR="${POSTTRAIN_SERVICES_DIR:-/tmp/posttrain-services}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN_DIR="${POSTTRAIN_BIN_DIR:-$REPO_ROOT/.venv/bin}"
PYTHON="$BIN_DIR/python"

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

# running PID: the process exists and is not a zombie (an orphaned daemon waits
# as a zombie until PID 1 reaps it, and kill -0 still succeeds on it).
running() {
  kill -0 "$1" 2>/dev/null || return 1
  local state; state="$(sed -E 's/^.*\) ([A-Za-z]) .*$/\1/' "/proc/$1/stat" 2>/dev/null || true)"
  [ "$state" != Z ]
}

# pid_alive PIDFILE [PATTERN]: the recorded process runs (and its command line
# contains PATTERN, so a recycled pid is not mistaken for ours).
pid_alive() {
  [ -s "$1" ] || return 1
  local pid; pid="$(cat "$1")"
  running "$pid" || return 1
  [ -z "${2:-}" ] && return 0
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$2"
}

# still_starting PIDFILE: the process a start script just started is still there. Its command line
# is not checked (pid_alive's PATTERN): while a process execs, /proc/PID/cmdline can read empty, and
# a start script took a SeaweedFS that was coming up for one that had exited.
still_starting() {
  [ -s "$1" ] && running "$(cat "$1")"
}

# wait_gone PID TENTHS: wait up to TENTHS/10 s for PID to exit.
wait_gone() {
  local i
  for ((i = 0; i < $2; i++)); do running "$1" || return 0; sleep 0.1; done
  ! running "$1"
}

# signal_tree SIG PID: signal PID's process group when PID leads one (our
# daemons are started with setsid), else PID alone.
signal_tree() {
  local pgid  # field 5 of /proc/PID/stat, after "(comm)" which may hold spaces
  pgid="$(sed -E 's/^.*\) [A-Za-z] -?[0-9]+ (-?[0-9]+) .*$/\1/' "/proc/$2/stat" 2>/dev/null || true)"
  if [ "$pgid" = "$2" ]; then kill "-$1" -- "-$2" 2>/dev/null; else kill "-$1" "$2" 2>/dev/null; fi
}

# stop_pidfile NAME PIDFILE [PATTERN] [WAIT_TENTHS]: SIGTERM, wait, SIGKILL; drop the pid file.
stop_pidfile() {
  local name="$1" f="$2" pattern="${3:-}" wait="${4:-100}" pid
  if pid_alive "$f" "$pattern"; then
    pid="$(cat "$f")"
    signal_tree TERM "$pid"
    if ! wait_gone "$pid" "$wait"; then
      echo "$name ($pid) ignored SIGTERM; killing it" >&2
      signal_tree KILL "$pid"; wait_gone "$pid" 30 || true
    fi
    echo "stopped $name (pid $pid)"
  fi
  rm -f "$f"
}

# stop_prefect_worker PID: a Prefect worker turns SIGTERM into SIGINT for itself
# and does not always exit on it (one was alive 10 min later); a second SIGTERM
# makes it SIGKILL itself. So: TERM, wait 3 s, TERM, wait 1 s, KILL.
stop_prefect_worker() {
  local pid="$1"
  running "$pid" || return 0
  signal_tree TERM "$pid"
  wait_gone "$pid" 30 && return 0
  signal_tree TERM "$pid"
  wait_gone "$pid" 10 && return 0
  signal_tree KILL "$pid"
  wait_gone "$pid" 30
}

# port_open PORT: something accepts TCP connections on 127.0.0.1:PORT.
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
