#!/usr/bin/env bash
# A new user's afternoon, replayed: the setup steps of docs/site-setup.md run as written from a
# fresh clone of this repository, against a Prefect server of its own on a non-default port.
#
#   bash scripts/site-trial.sh            the local path
#   bash scripts/site-trial.sh --slurm    the Slurm path, with the page's own values (below)
#   bash scripts/site-trial.sh --all      both, on one clone and one server (the test suite runs it,
#                                         or the local path where it cannot make /shared:
#                                         tests/e2e/test_site_trial.py)
#
# Steps, each checked (a failed check prints what it saw and exits 1):
#   1. a fresh `git clone` of this checkout's HEAD; the clone's code runs (PYTHONPATH), with this
#      checkout's .venv (installing a second one would take minutes and test pip, not posttrain)
#   2. mistakes caught with one line: prefect-setup with PREFECT_API_URL pointing at nothing (the
#      URL named), deploy --all without POSTTRAIN_IMAGE (the variable named, nothing deployed)
#   3. a Prefect server on TRIAL_PORT (default 4455) whose UI is told that port, prefect-setup, `posttrain blocks save` from a
#      site file, `prefect --no-prompt deploy --all`, a process worker
#   4. a reference inference server (`posttrain serve`) that the inference block names
#   5. `prefect deployment run 'nightly-post-training/nightly' --param learning_rate=5e-5 --watch`:
#      Completed, that parameter alone differs from the deployment's, every checkpoint served
#   6. `posttrain chain inspect` and `chain verify` on the store the runs published to
# (Cancelling a deployment run once its trainer runs, which it also did, is the suite's: the run that
# holds the slot in tests/pipeline/test_flows_concurrency.py, started and cancelled the same way.)
# Everything it started is stopped at the end; its files are under TRIAL_DIR (default: a new /tmp folder).
#
# --slurm: the page's Slurm path on the Slurm cluster `sinfo` answers (the test suite's: 2 nodes on
# this host), with the values the page's code blocks hold, read from docs/site-setup.md itself: the
# deploy's POSTTRAIN_BASE_MODEL, POSTTRAIN_DATASET and POSTTRAIN_SHARED_DIR, the Slurm block's
# settings, the deploy command without Kubernetes and the `prefect deployment run ... --param
# cluster=posttrain-slurm-cluster/...` line. The block's fields that describe the site's hardware
# (partition, gpus_per_node) and how its nodes find Python are set for this cluster, as a reader
# edits them; its shared_dir is kept. The page's shared file system (/shared) is made here: a link
# to a folder of the trial, which the nodes see (they are this host); so it needs root, and /shared
# absent (or a dangling link an earlier trial left). Step 5 becomes: `deploy --all` without the
# Kubernetes variables, then the command it suggests, run as printed (the page's, which deploys
# promote and rollback too); a run on a block whose shared_dir is the page's old value (/mnt/shared)
# fails before anything is staged, naming base_model and the block's fields; the page's run line on
# its Slurm block completes, its job in the block's job folder, its last checkpoint served.
# --all: the Slurm path's values and steps, then the local path's deploy line. Its step 5 is left out:
# the Slurm path's run is a run of the same deployment with a parameter changed (cluster), checked the
# same way; the local block's runs are the rest of the suite's (tests/pipeline).
set -euo pipefail
MODE=local
case "${1:-}" in
  --slurm) MODE=slurm ;;
  --all) MODE=all ;;
  "") ;;
  *) echo "usage: bash scripts/site-trial.sh [--slurm | --all]" >&2; exit 2 ;;
esac
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
slurm_path() { [ "$MODE" != local ]; }  # --slurm, --all
local_path() { [ "$MODE" != slurm ]; }  # no option, --all
fail() { printf '[site-trial] FAILED: %s\n' "$*" >&2; exit 1; }
pids=()
SHARED_LINK=""  # the page's shared file system, made by --slurm (a link to a folder of the trial)
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  sleep 2
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
  if [ -n "$SHARED_LINK" ]; then  # this trial's Slurm jobs (their folders are on the link), then the link
    squeue -h -o '%i|%Z|%o' 2>/dev/null | grep -F -e "$SHARED_LINK/" -e "$DIR/" | cut -d'|' -f1 \
      | xargs -r scancel 2>/dev/null || true
    [ "$(readlink "$SHARED_LINK" 2>/dev/null)" = "$DIR/site-fs" ] && rm -f "$SHARED_LINK"
  fi
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
# the UI asks /ui-settings for its API URL: this server's port, not Prefect's default 4200
ui_api="$("$PY" -c 'import json, sys, urllib.request as u; print(json.load(u.urlopen(sys.argv[1], timeout=10))["api_url"])' \
  "http://127.0.0.1:$PORT/ui-settings" 2>&1)" || fail "the server's /ui-settings: $ui_api"
[ "$ui_api" = "$PREFECT_API_URL" ] || fail "the UI is told the API is at $ui_api, not $PREFECT_API_URL"
"$PY" -m posttrain prefect-setup >"$DIR/setup.log" 2>&1 || fail "prefect-setup: $(cat "$DIR/setup.log")"
grep -q "automation: posttrain-crash-unresponsive-runs" "$DIR/setup.log" || fail "no lost-worker automation: $(cat "$DIR/setup.log")"
say "ok: server on port $PORT, its UI told that port; $(tr '\n' ';' < "$DIR/setup.log")"

if slurm_path; then
  # the page's values, from its code blocks (DOC_* variables; DOC_SLURM: the block's settings as JSON)
  doc_values="$("$PY" - docs/site-setup.md <<'EOF'
import json, re, shlex, sys
import yaml
text = open(sys.argv[1]).read()
blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
setup = blocks[0][1]  # the page's first block: the whole setup
values = dict(re.findall(r"\bPOSTTRAIN_(BASE_MODEL|DATASET|SHARED_DIR)=(\S+)", setup))
run = next(line for line in setup.splitlines()
           if line.startswith("prefect deployment run ") and "posttrain-slurm-cluster/" in line)
without_k8s = next(line.split(":", 1)[1].strip() for line in setup.splitlines() if line.startswith("# without Kubernetes:"))
slurm = next(yaml.safe_load(body) for lang, body in blocks if lang == "yaml" and "posttrain-slurm-cluster/" in body)
block, = (k for k in slurm if k.startswith("posttrain-slurm-cluster/"))
for name, value in {**{f"DOC_{k}": v for k, v in values.items()}, "DOC_RUN": run, "DOC_DEPLOY": without_k8s,
                    "DOC_BLOCK": block, "DOC_SLURM": json.dumps(slurm[block]["settings"])}.items():
    print(f"{name}={shlex.quote(value)}")
EOF
)" || fail "docs/site-setup.md: its Slurm values could not be read"
  eval "$doc_values"
  SHARED_ROOT="/$(printf '%s' "$DOC_SHARED_DIR" | cut -d/ -f2)"  # the file system's mount point: /shared
  say "the page's values: base_model $DOC_BASE_MODEL, dataset $DOC_DATASET, shared_dir $DOC_SHARED_DIR, $DOC_BLOCK $DOC_SLURM"
  exec 9>/tmp/posttrain-site-trial-slurm.lock
  flock -w 900 9 || fail "another --slurm trial holds /tmp/posttrain-site-trial-slurm.lock"
  if [ -L "$SHARED_ROOT" ] && [ ! -e "$SHARED_ROOT" ]; then rm -f "$SHARED_ROOT"; fi  # an earlier trial's, its folder gone
  [ -e "$SHARED_ROOT" ] && fail "$SHARED_ROOT exists: the Slurm trial makes the page's shared file system there (a link)"
  mkdir -p "$DIR/site-fs"
  ln -s "$DIR/site-fs" "$SHARED_ROOT" || fail "cannot make $SHARED_ROOT (root needed)"
  SHARED_LINK="$SHARED_ROOT"
  BASE_MODEL="$DOC_BASE_MODEL" DATASET="$DOC_DATASET"
else
  BASE_MODEL="$DIR/models/base" DATASET="$DIR/data/prompts.jsonl"
fi
"$PY" - "$BASE_MODEL" "$DATASET" <<'EOF'
import sys
from posttrain.datasets.toy import write_toy_jsonl
from posttrain.models.tiny import build_tiny_model
build_tiny_model(sys.argv[1], seed=0)
write_toy_jsonl(sys.argv[2], n=16, seed=0, task="mixed")
EOF
export SITE_GATEWAY_TOKEN="trial-$RANDOM$RANDOM"
GW_PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
background "$DIR/serve.log" "$PY" -m posttrain serve --model "$BASE_MODEL" --served-model-name tiny \
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
if slurm_path; then
  "$PY" - "$DOC_BLOCK" "$DOC_SLURM" "$PY" "$DIR/clone" >>"$DIR/blocks.yaml" <<'EOF'
import json, socket, sys
import yaml
block, settings, python, clone = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
# this cluster's hardware and Python, as a reader sets them; shared_dir as the page has it
settings.pop("partition", None)  # the cluster's default partition
settings.update(gpus_per_node=0, memory="1G", exclusive=False, time_limit="10", poll_interval_s=1, python=python,
                master_port=port, env={"PATH": f"{python.rsplit('/', 1)[0]}:/usr/bin:/bin", "PYTHONPATH": clone,
                                       "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
mismatch = {**settings, "shared_dir": "/mnt/shared"}  # the page's block before issue 37
print(yaml.safe_dump({block: {"settings": settings}, "posttrain-slurm-cluster/mismatch": {"settings": mismatch}}))
EOF
fi
"$PY" -m posttrain blocks save --from "$DIR/blocks.yaml" >"$DIR/blocks.log" 2>&1 || fail "blocks save: $(cat "$DIR/blocks.log")"
grep -q "$SITE_GATEWAY_TOKEN" "$DIR/blocks.log" && fail "blocks save printed the token"
say "ok: blocks saved ($(tr '\n' ' ' < "$DIR/blocks.log"))"

if slurm_path; then
  export POSTTRAIN_BASE_MODEL="$DOC_BASE_MODEL" POSTTRAIN_DATASET="$DOC_DATASET" POSTTRAIN_SHARED_DIR="$DOC_SHARED_DIR"
else
  export POSTTRAIN_BASE_MODEL="$DIR/models/base" POSTTRAIN_DATASET="$DIR/data/prompts.jsonl" POSTTRAIN_SHARED_DIR="$DIR/shared"
fi
out="$(env -u POSTTRAIN_IMAGE "$PY" -m prefect --no-prompt deploy --all 2>&1)" && fail "deploy without POSTTRAIN_IMAGE succeeded"
[[ "$out" == *POSTTRAIN_IMAGE* ]] && ! [[ "$out" == *Traceback* ]] || fail "deploy without POSTTRAIN_IMAGE: $out"
[ "$("$PY" -m prefect deployment ls 2>/dev/null | grep -c 'nightly-post-training/nightly ')" -eq 0 ] \
  || fail "deploy without POSTTRAIN_IMAGE deployed something"
say "ok: deploy --all without POSTTRAIN_IMAGE is one line and deploys nothing"
if slurm_path; then  # no Kubernetes: the command the line suggests, as printed (the page's too)
  suggested="${out##*deploy the others alone: }"
  [ "$suggested" = "$DOC_DEPLOY" ] || fail "deploy --all suggests '$suggested'; docs/site-setup.md says '$DOC_DEPLOY'"
  PWD="$DIR/clone" bash -c "$suggested" >"$DIR/deploy-suggested.log" 2>&1 || fail "$suggested: $(tail -20 "$DIR/deploy-suggested.log")"
  deployed="$("$PY" -m prefect deployment ls 2>/dev/null)"
  for d in nightly-post-training/nightly grpo/grpo promote/promote rollback/rollback; do
    grep -q "$d " <<<"$deployed" || fail "$suggested did not deploy $d: $deployed"
  done
  say "ok: deployed with the suggested command: $suggested"
fi
PREFECT_WORKER_QUERY_SECONDS=1 background "$DIR/worker.log" "$PY" -m prefect worker start --pool posttrain-process
background "$DIR/recover.log" "$PY" -m posttrain recover  # beside the worker, as the page says
for _ in $(seq 120); do grep -q "started" "$DIR/worker.log" && break; sleep 0.5; done
grep -q "started" "$DIR/worker.log" || fail "the worker did not start: $(tail -5 "$DIR/worker.log")"
for _ in $(seq 120); do curl -fsS -o /dev/null -H "Authorization: Bearer $SITE_GATEWAY_TOKEN" "http://127.0.0.1:$GW_PORT/health" && break; sleep 0.5; done
say "ok: worker and inference server up"

small=(--param max_steps=2 --param save_steps=1 --param per_device_train_batch_size=4 --param num_generations=2
       --param max_completion_length=4 --param use_cpu=true --param watch_poll_s=0.5)
if slurm_path; then  # first: its checks count the runs on the page's shared_dir
  # 5s. the page's old block (shared_dir /mnt/shared): refused before the dataset is staged
  "$PY" -m prefect deployment run 'nightly-post-training/nightly' --param cluster=posttrain-slurm-cluster/mismatch \
    "${small[@]}" --watch --watch-timeout 300 >"$DIR/mismatch.log" 2>&1 && fail "a run on the mismatched block succeeded"
  RUN_ID="$(grep -oE '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}' "$DIR/mismatch.log" | head -1)"
  "$PY" - "$RUN_ID" "$DOC_BASE_MODEL" <<'EOF' || fail "the mismatched run's checks: $(tail -20 "$DIR/mismatch.log")"
import sys
from prefect import get_client
with get_client(sync_client=True) as c:
    state = c.read_flow_run(sys.argv[1]).state
expected = (f"base_model: {sys.argv[2]} is not on the cluster's shared storage (under neither shared_dir /mnt/shared "
            "nor mounts (none) of block posttrain-slurm-cluster/mismatch); the nodes would not see it")
assert state.is_failed() and expected in (state.message or ""), (state, state.message)
print(f"Failed: {state.message}")
EOF
  [ -e "$DOC_SHARED_DIR/datasets" ] && fail "the mismatched run staged the dataset: $(ls "$DOC_SHARED_DIR/datasets")"
  [ -e /mnt/shared/posttrain-jobs ] && fail "the mismatched run made a job folder"
  say "ok: a Slurm block whose shared_dir does not hold the page's paths fails before staging, naming base_model and shared_dir"

  # 6s. the page's run line on its Slurm block
  eval "$DOC_RUN" '"${small[@]}"' --watch --watch-timeout 400 >"$DIR/run.log" 2>&1 \
    || fail "$DOC_RUN: $(tail -30 "$DIR/run.log"); the worker: $(tail -30 "$DIR/worker.log")"
  RUN_ID="$(grep -oE '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}' "$DIR/run.log" | head -1)"
  "$PY" - "$RUN_ID" "http://127.0.0.1:$GW_PORT" "$DOC_SHARED_DIR" "$(printf '%s' "$DOC_SLURM" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["shared_dir"])')" <<'EOF' \
    || fail "the Slurm run's checks"
import json, os, sys, urllib.request
from pathlib import Path
from prefect import get_client
run_id, gateway, shared_dir, block_shared = sys.argv[1:5]
with get_client(sync_client=True) as c:
    run = c.read_flow_run(run_id)
    deployment = c.read_deployment(run.deployment_id)
assert run.state.is_completed(), run.state
assert run.parameters["cluster"].startswith("posttrain-slurm-cluster/"), run.parameters["cluster"]
changed = {k for k, v in run.parameters.items() if deployment.parameters.get(k) != v}
assert "cluster" in changed, (run.parameters, changed)  # the page's --param, the deployment's values for the rest
assert run.name.startswith("nightly-") and run.name.count("-") >= 4, run.name  # date and a short id
# the run's folder on the page's shared_dir (the mismatched run made none), its job in the block's
ckpts = list(Path(shared_dir, "runs").glob("*/output/checkpoint-2"))
assert len(ckpts) == 1, sorted(Path(shared_dir).glob("*/*/*"))
jobs = [p for p in Path(block_shared, "posttrain-jobs").glob("*") if (p / "sbatch.sh").is_file()]
assert len(jobs) == 1, sorted(Path(block_shared, "posttrain-jobs").glob("*"))  # one Slurm job, from sbatch
request = urllib.request.Request(gateway + "/health", headers={"Authorization": "Bearer " + os.environ["SITE_GATEWAY_TOKEN"]})
served = json.load(urllib.request.urlopen(request, timeout=10))["snapshotIdentity"]
assert served and served.startswith("step-00000002-"), served
print(f"run {run.name}: Completed on Slurm, {ckpts[0].parents[1]}, job folder {jobs[0]}, serving {served}")
EOF
  say "ok: the page's run on its Slurm block completed, with the page's paths, and its last checkpoint is served"
fi
if local_path; then
  # the page's deploy line (with --all: after the Slurm path ran on what the suggested command deployed)
  POSTTRAIN_IMAGE=registry/posttrain:trial POSTTRAIN_PVC=shared PWD="$DIR/clone" "$PY" -m prefect --no-prompt deploy --all >"$DIR/deploy.log" 2>&1 \
    || fail "deploy --all: $(tail -20 "$DIR/deploy.log")"
  say "ok: deployed"
fi
if [ "$MODE" = local ]; then  # (--all: the Slurm path's run is the one run, its --param checked the same way)
  # 5. a run with one parameter changed
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

fi

# 6. the chain the runs published
"$PY" -m posttrain chain inspect "$DIR/store" >"$DIR/inspect.log" 2>&1 || fail "chain inspect: $(cat "$DIR/inspect.log")"
grep -qE "│ full .*│ +100\.00 │" "$DIR/inspect.log" || fail "chain inspect: no full snapshot at 100 % of full: $(cat "$DIR/inspect.log")"
"$PY" -m posttrain chain verify "$DIR/store" >"$DIR/verify.log" 2>&1 || fail "chain verify: $(cat "$DIR/verify.log")"
say "ok: chain inspect and verify"
say "PASSED in $SECONDS s ($DIR)"
