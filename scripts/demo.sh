#!/usr/bin/env bash
# Set up .venv and run the main job end to end on the embedded defaults: a Prefect server on
# 127.0.0.1, a local training process, a folder object store, the reference inference server and
# the real model (SmolLM2-135M-Instruct, prepared once into ~/.cache/posttrain/models; --model tiny:
# a tiny model built here). The Prefect server keeps running afterwards, to look at the runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false
bash scripts/services/start-prefect.sh
export PREFECT_API_URL="http://127.0.0.1:${PREFECT_PORT:-4200}/api"
.venv/bin/posttrain demo "$@"
echo "Prefect server: stop it with: bash scripts/services/stop-prefect.sh"
