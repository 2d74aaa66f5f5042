#!/usr/bin/env bash
# Start a Prometheus server (Debian's `prometheus` package) on loopback with its own data folder,
# scraping the targets listed in a file that tests write at run time. Idempotent. Prints one
# "PROMETHEUS READY <url> ..." line once its HTTP API answers.
#
#   POSTTRAIN_PROMETHEUS_PORT  (default 9390) http://127.0.0.1:$POSTTRAIN_PROMETHEUS_PORT, loopback only
#   POSTTRAIN_PROMETHEUS_DIR   (default $POSTTRAIN_SERVICES_DIR/prometheus) data/, prometheus.yml, log, pid,
#                              and what tests write there:
#                                targets.json   file_sd targets ([{"targets": ["127.0.0.1:PORT"], "labels": {}}]),
#                                               re-read every second
#                                token          the bearer token sent to every target (may be absent)
#
# Scrapes every second (scrape_interval 1s), job "posttrain". apt-get installs `prometheus` when it is
# missing; the package's own service (on :9090) is stopped and disabled if apt started it.
# Stop with stop-prometheus.sh (same environment).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
RUN="${POSTTRAIN_PROMETHEUS_DIR:-$SERVICES_DIR/prometheus}"
PORT="${POSTTRAIN_PROMETHEUS_PORT:-9390}"
URL="http://127.0.0.1:$PORT"
PIDF="$RUN/prometheus.pid"
t0="$(now)"

BIN="$(command -v prometheus || true)"
if [ -z "$BIN" ]; then
  [ "$(id -u)" = 0 ] || { echo "Prometheus is not installed; as root: apt-get install prometheus" >&2; exit 1; }
  echo "installing Prometheus (apt-get)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >&2 \
    || { DEBIAN_FRONTEND=noninteractive apt-get update -q >&2 &&
         DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >&2; }
  # the package's service (all interfaces, :9090) is not wanted: stopped and disabled where it started
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
    systemctl disable --now prometheus >&2 || true
  fi
  if [ -s /run/prometheus.pid ] || pgrep -x prometheus -u prometheus >/dev/null 2>&1; then
    for pid in $(pgrep -x prometheus -u prometheus 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
  fi
  BIN="$(command -v prometheus)"
fi

mkdir -p "$RUN/data"
[ -f "$RUN/targets.json" ] || echo '[]' > "$RUN/targets.json"
cat > "$RUN/prometheus.yml" <<YML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: posttrain
    authorization:
      type: Bearer
      credentials_file: $RUN/token
    file_sd_configs:
      - files: ["$RUN/targets.json"]
        refresh_interval: 1s
YML
[ -f "$RUN/token" ] || { umask 077; echo "no-token" > "$RUN/token"; }

ready() { "$PYTHON" - "$URL" <<'PY'
import sys, time, urllib.request
deadline = time.monotonic() + 60
while True:
    try:
        with urllib.request.urlopen(sys.argv[1] + "/-/ready", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("Prometheus did not become ready in 60 s")
    time.sleep(0.2)
PY
}

if pid_alive "$PIDF" prometheus; then
  running_port="$(cat "$RUN/port" 2>/dev/null || echo '?')"
  if [ "$running_port" != "$PORT" ]; then
    echo "Prometheus from $RUN already runs on port $running_port (pid $(cat "$PIDF")); stop-prometheus.sh first" >&2
    exit 1
  fi
  kill -HUP "$(cat "$PIDF")"  # re-read prometheus.yml
  ready || exit 1
  echo "PROMETHEUS READY $URL (already running, pid $(cat "$PIDF"))"; exit 0
fi
if port_open "$PORT"; then echo "port $PORT is taken by another process" >&2; exit 1; fi
echo "$PORT" > "$RUN/port"
rm -f "$PIDF"
# --web.listen-address on loopback only; the TSDB in its own folder, kept a day at most
setsid bash -c 'echo $$ > "$0"; exec "$@"' "$PIDF" "$BIN" --config.file="$RUN/prometheus.yml" \
  --storage.tsdb.path="$RUN/data" --storage.tsdb.retention.time=1d --web.listen-address="127.0.0.1:$PORT" \
  --web.enable-lifecycle </dev/null >"$RUN/prometheus.log" 2>&1 &
for _ in $(seq 50); do [ -s "$PIDF" ] && break; sleep 0.1; done
if ! ready; then
  echo "Prometheus not ready; stopping it. See $RUN/prometheus.log" >&2
  stop_pidfile prometheus "$PIDF" prometheus 100 >&2
  exit 1
fi
echo "PROMETHEUS READY $URL (pid $(cat "$PIDF")) in $(since "$t0")s"
