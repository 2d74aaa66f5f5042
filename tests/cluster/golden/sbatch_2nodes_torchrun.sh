#!/bin/bash

# Parameters
#SBATCH --account=ml-team
#SBATCH --chdir=/mnt/shared/posttrain-jobs/grpo-nightly-20250101-000000-abcd
#SBATCH --comment=posttrain:grpo-nightly-20250101-000000-abcd
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
#SBATCH --job-name=grpo-nightly
#SBATCH --mem=0
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/mnt/shared/posttrain-jobs/grpo-nightly-20250101-000000-abcd/%j_0_log.out
#SBATCH --partition=h100
#SBATCH --qos=normal
#SBATCH --requeue
#SBATCH --signal=USR2@120
#SBATCH --time=720

# setup
set -euo pipefail
mapfile -t posttrain_nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
# rendezvous: the first node's NodeAddr (what Slurm reaches it by), else its name
MASTER_ADDR="$(scontrol show node "${posttrain_nodes[0]}" 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' | head -n 1)" || true
export MASTER_ADDR="${MASTER_ADDR:-${posttrain_nodes[0]}}"
export MASTER_PORT=29500
export POSTTRAIN_JOB_DIR=/mnt/shared/posttrain-jobs/grpo-nightly-20250101-000000-abcd

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /mnt/shared/posttrain-jobs/grpo-nightly-20250101-000000-abcd/%j_%t_log.out --kill-on-bad-exit=1 --ntasks-per-node=1 '--container-image=docker://ghcr.io#example/posttrain:1.0' --container-mounts=/mnt/shared:/mnt/shared,/mnt/data:/mnt/data --container-env=MASTER_ADDR,MASTER_PORT,POSTTRAIN_JOB_DIR,SUBMITIT_EXECUTOR --container-workdir=/mnt/shared/posttrain-jobs/grpo-nightly-20250101-000000-abcd --no-container-mount-home /bin/bash /mnt/shared/posttrain-jobs/grpo-nightly-20250101-000000-abcd/node.sh python3 -u -m submitit.core._submit /mnt/shared/posttrain-jobs/grpo-nightly-20250101-000000-abcd
