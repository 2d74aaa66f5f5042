#!/bin/bash
# posttrain job grpo-nightly (run 20250101-000000-abcd): srun runs this once per node,
# inside the container when an image is set, before submitit's entry point.
set -euo pipefail
readonly MASTER_ADDR MASTER_PORT POSTTRAIN_JOB_DIR
set -a
source /mnt/shared/secrets/train.env
set +a
# DB_PASS, GITHUB_PAT: written at submit time (mode 0600), values never rendered
set -a
source /mnt/shared/posttrain-jobs/grpo-nightly-20250101-000000-abcd/secrets.env
set +a
export NCCL_DEBUG=WARN
export RUN_LABEL=nightly
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
nvidia-smi -L
exec "$@"
