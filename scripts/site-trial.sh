#!/usr/bin/env bash
# A new user's afternoon, replayed: the setup steps of docs/site-setup.md run as written from a
# fresh clone of this repository, against a Prefect server of its own on a non-default port.
#
#   bash scripts/site-trial.sh            (the test suite runs it: tests/pipeline/test_site_trial.py)
#
# Steps, each checked (a failed check prints what it saw and exits 1):
#   1. a fresh `git clone` of this checkout's HEAD; the clone's code runs (PYTHONPATH), with this
#      checkout's .venv (installing a second one would take minutes and test pip, not posttrain)
#   2. mistakes caught with one line: prefect-setup with PREFECT_API_URL pointing at nothing (the
#      URL named), deploy --all without POSTTRAIN_IMAGE (the variable named, nothing deployed)
#   3. a Prefect server on TRIAL_PORT (default 4455), prefect-setup, `posttrain blocks save` from a
#      site file, `prefect --no-prompt deploy --all`, a process worker
#   4. a reference inference server (`posttrain serve`) that the inference block names
#   5. `prefect deployment run 'nightly-post-training/nightly' --param learning_rate=5e-5 --watch`:
#      Completed, that parameter alone differs from the deployment's, every checkpoint served
#   6. a second run cancelled once its trainer runs: Cancelled, the trainer gone
#   7. `posttrain chain inspect` and `chain verify` on the store the runs published to
# Everything it started is stopped at the end; its files are under TRIAL_DIR (default: a new /tmp folder).
set -euo pipefail
SRC="$(cd "$(dirname "$0")/.." && pwd)"
PY="${POSTTRAIN_PYTHON:-$SRC/.venv/bin/python}"
PORT="${TRIAL_PORT:-4455}"
DIR="${TRIAL_DIR:-$(mktemp -d /tmp/posttrain-site-trial-XXXXXX)}"
mkdir -p "$DIR"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
# its own server on SQLite, whatever the caller's environment (the test suite's names PostgreSQL)
export POSTTRAIN_PREFECT_DB=sqlite
unset PREFECT_API_URL PREFECT_PORT POSTTRAIN_PREFECT_DIR

say() { printf '[site-trial] %s\n' "$*"; }
fail() { printf '[site-trial] FAILED: %s\n' "$*" >&2; exit 1; }
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  sleep 2
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
  if [ -d "$DIR/clone" ]; then
    (cd "$DIR/clone" && PREFECT_PORT="$PORT" POSTTRAIN_PREFECT_DIR="$DIR/prefect" \
      bash scripts/services/stop-prefect.sh >/dev/null 2>&1) || true
  fi
}
trap cleanup EXIT
background() {  # background LOG CMD...: run in a process group of its own, stopped at exit
  local log="$1"; shift
  setsid "$@" >"$log" 2>&1 < /dev/null &
  pids+=("$!")
}

# 1. a fresh clone
git clone --quiet --no-hardlinks "$SRC" "$DIR/clone"
cd "$DIR/clone"
export PYTHONPATH="$DIR/clone" PATH="$(dirname "$PY"):$PATH"
[ "$("$PY" -c 'import posttrain, pathlib; print(pathlib.Path(posttrain.__file__).parents[1])')" = "$DIR/clone" ] \
  || fail "the clone's posttrain is not the one imported"
say "clone of $(git rev-parse --short HEAD) in $DIR/clone"

# 2. mistakes a new user makes, caught with one line
out="$(PREFECT_API_URL=http://127.0.0.1:9/api "$PY" -m posttrain prefect-setup 2>&1)" && fail "prefect-setup against nothing succeeded"
[ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ] && [[ "$out" == *"PREFECT_API_URL=http://127.0.0.1:9/api"* ]] \
  || fail "prefect-setup against nothing: not one line naming the URL: $out"
say "ok: a PREFECT_API_URL where nothing answers is one line"

# 3. the server, the work pools, the blocks, the deployments, a worker
PREFECT_PORT="$PORT" POSTTRAIN_PREFECT_DIR="$DIR/prefect" POSTTRAIN_BIN_DIR="$(dirname "$PY")" \
  bash scripts/services/start-prefect.sh >"$DIR/prefect-start.log" 2>&1 || fail "Prefect server: $(tail -5 "$DIR/prefect-start.log")"
export PREFECT_API_URL="http://127.0.0.1:$PORT/api"
"$PY" -m posttrain prefect-setup >"$DIR/setup.log" 2>&1 || fail "prefect-setup: $(cat "$DIR/setup.log")"
grep -q "automation: posttrain-crash-unresponsive-runs" "$DIR/setup.log" || fail "no lost-worker automation: $(cat "$DIR/setup.log")"
say "ok: server on port $PORT; $(tr '\n' ';' < "$DIR/setup.log")"

"$PY" - "$DIR" <<'EOF'
import sys
from pathlib import Path
from posttrain.datasets.toy import write_toy_jsonl
from posttrain.models.tiny import build_tiny_model
root = Path(sys.argv[1])
build_tiny_model(root / "models" / "base", seed=0)
write_toy_jsonl(root / "data" / "prompts.jsonl", n=16, seed=0, task="mixed")
EOF
export SITE_GATEWAY_TOKEN="trial-$RANDOM$RANDOM"
GW_PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
background "$DIR/serve.log" "$PY" -m posttrain serve --model "$DIR/models/base" --served-model-name tiny \
  --deployment-id site-trial --store "$DIR/store" --work-dir "$DIR/gateway" --port "$GW_PORT" --token-env SITE_GATEWAY_TOKEN
cat >"$DIR/blocks.yaml" <<EOF
posttrain-local-cluster/default:
  settings: {folder: $DIR/jobs}
posttrain-object-store/default:
  uri: $DIR/store
posttrain-inference-deployment/default:
  api_url: http://127.0.0.1:$GW_PORT
  gateway_url: http://127.0.0.1:$GW_PORT
  deployment_id: site-trial
  model: tiny
  token: {env: SITE_GATEWAY_TOKEN}
EOF
"$PY" -m posttrain blocks save --from "$DIR/blocks.yaml" >"$DIR/blocks.log" 2>&1 || fail "blocks save: $(cat "$DIR/blocks.log")"
grep -q "$SITE_GATEWAY_TOKEN" "$DIR/blocks.log" && fail "blocks save printed the token"
say "ok: blocks saved ($(tr '\n' ' ' < "$DIR/blocks.log"))"

export POSTTRAIN_BASE_MODEL="$DIR/models/base" POSTTRAIN_DATASET="$DIR/data/prompts.jsonl" POSTTRAIN_SHARED_DIR="$DIR/shared"
out="$(env -u POSTTRAIN_IMAGE "$PY" -m prefect --no-prompt deploy --all 2>&1)" && fail "deploy without POSTTRAIN_IMAGE succeeded"
[[ "$out" == *POSTTRAIN_IMAGE* ]] && ! [[ "$out" == *Traceback* ]] || fail "deploy without POSTTRAIN_IMAGE: $out"
[ "$("$PY" -m prefect deployment ls 2>/dev/null | grep -c 'nightly-post-training/nightly ')" -eq 0 ] \
  || fail "deploy without POSTTRAIN_IMAGE deployed something"
say "ok: deploy --all without POSTTRAIN_IMAGE is one line and deploys nothing"
POSTTRAIN_IMAGE=registry/posttrain:trial POSTTRAIN_PVC=shared PWD="$DIR/clone" "$PY" -m prefect --no-prompt deploy --all >"$DIR/deploy.log" 2>&1 \
  || fail "deploy --all: $(tail -20 "$DIR/deploy.log")"
say "ok: deployed"
PREFECT_WORKER_QUERY_SECONDS=1 background "$DIR/worker.log" "$PY" -m prefect worker start --pool posttrain-process
for _ in $(seq 120); do grep -q "started" "$DIR/worker.log" && break; sleep 0.5; done
grep -q "started" "$DIR/worker.log" || fail "the worker did not start: $(tail -5 "$DIR/worker.log")"
for _ in $(seq 120); do curl -fsS -o /dev/null -H "Authorization: Bearer $SITE_GATEWAY_TOKEN" "http://127.0.0.1:$GW_PORT/health" && break; sleep 0.5; done
say "ok: worker and inference server up"

# 5. a run with one parameter changed
small=(--param max_steps=2 --param save_steps=1 --param per_device_train_batch_size=4 --param num_generations=2
       --param max_completion_length=4 --param use_cpu=true --param watch_poll_s=0.5)
"$PY" -m prefect deployment run 'nightly-post-training/nightly' --param learning_rate=5e-5 "${small[@]}" \
  --watch --watch-timeout 400 >"$DIR/run.log" 2>&1 || fail "the nightly run: $(tail -30 "$DIR/run.log")"
RUN_ID="$(grep -oE '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}' "$DIR/run.log" | head -1)"
"$PY" - "$RUN_ID" "http://127.0.0.1:$GW_PORT" <<'EOF' || fail "the nightly run's checks"
import json, os, sys, urllib.request
from prefect import get_client
with get_client(sync_client=True) as c:
    run = c.read_flow_run(sys.argv[1])
    deployment = c.read_deployment(run.deployment_id)
assert run.state.is_completed(), run.state
changed = {k for k, v in run.parameters.items() if deployment.parameters.get(k) != v}
assert run.parameters["learning_rate"] == 5e-5 and "learning_rate" in changed, (run.parameters, changed)
assert run.name.startswith("nightly-") and run.name.count("-") >= 4, run.name  # date and a short id
request = urllib.request.Request(sys.argv[2] + "/health", headers={"Authorization": "Bearer " + os.environ["SITE_GATEWAY_TOKEN"]})
served = json.load(urllib.request.urlopen(request, timeout=10))["snapshotIdentity"]
assert served and served.startswith("step-00000002-"), served
print(f"run {run.name}: Completed, changed {sorted(changed)}, serving {served}")
EOF
say "ok: nightly run with --param learning_rate=5e-5 completed and its last checkpoint is served"

# 6. cancel a run once its trainer runs
"$PY" -m prefect deployment run 'nightly-post-training/nightly' --param max_steps=100000 --param save_steps=100000 \
  "${small[@]:4}" >"$DIR/cancel.log" 2>&1 || fail "the run to cancel: $(tail -20 "$DIR/cancel.log")"
CANCEL_ID="$(grep -oE '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}' "$DIR/cancel.log" | head -1)"
for _ in $(seq 240); do pgrep -f "posttrain.trainer $DIR/jobs" >/dev/null && break; sleep 0.5; done
pgrep -f "posttrain.trainer $DIR/jobs" >/dev/null || fail "the trainer of the run to cancel never started: $(tail -20 "$DIR/worker.log")"
"$PY" -m prefect flow-run cancel "$CANCEL_ID" >/dev/null || fail "prefect flow-run cancel"
for _ in $(seq 120); do pgrep -f "posttrain.trainer $DIR/jobs" >/dev/null || break; sleep 0.5; done
pgrep -f "posttrain.trainer $DIR/jobs" >/dev/null && fail "the trainer is still running 60 s after the cancel"
"$PY" - "$CANCEL_ID" <<'EOF' || fail "the cancelled run's state"
import sys, time
from prefect import get_client
with get_client(sync_client=True) as c:
    for _ in range(120):
        state = c.read_flow_run(sys.argv[1]).state
        if state.is_final():
            break
        time.sleep(0.5)
assert state.is_cancelled(), state
EOF
say "ok: a cancelled run stopped its trainer and is Cancelled"

# 7. the chain the runs published
"$PY" -m posttrain chain inspect "$DIR/store" >"$DIR/inspect.log" 2>&1 || fail "chain inspect: $(cat "$DIR/inspect.log")"
grep -qE "│ full .*│ +100\.00 │" "$DIR/inspect.log" || fail "chain inspect: no full snapshot at 100 % of full: $(cat "$DIR/inspect.log")"
"$PY" -m posttrain chain verify "$DIR/store" >"$DIR/verify.log" 2>&1 || fail "chain verify: $(cat "$DIR/verify.log")"
say "ok: chain inspect and verify"
say "PASSED in $SECONDS s ($DIR)"
