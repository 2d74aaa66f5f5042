#!/usr/bin/env bash
# posttrain serve --engine vllm against vLLM's CUDA build, on a GPU machine (never in CI).
#
# The same end-to-end check as tests/serve/vllm/test_vllm_gateway.py's first test: a tiny Qwen2
# (untied, then tied) published full -> delta -> delta, each hot-loaded by the gateway into the
# vLLM it starts from the venv below; vLLM's greedy tokens and logprobs must match transformers'
# on the GPU. Prints PASS/FAIL per step (scripts/gpu/check_vllm_cuda.py); exits non-zero on failure.
#
#   VLLM_CUDA_VENV  (default <repo>/.venv-vllm-cuda) venv created here with vllm (CUDA wheels)
#   VLLM_CUDA_PIN   (default vllm==0.32.0: the version of the CPU build, with the dev-mode
#                    endpoints /pause, /resume, /collective_rpc the gateway uses)
#   PROJECT_PYTHON  (default <repo>/.venv/bin/python, from scripts/setup.sh) runs the gateway
#   DTYPE           (default float32; bfloat16 compares with a looser tolerance)
#   PYTHON          (default python3) creates the venv
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VLLM_CUDA_VENV:-$REPO_ROOT/.venv-vllm-cuda}"
PIN="${VLLM_CUDA_PIN:-vllm==0.32.0}"
PROJECT_PY="${PROJECT_PYTHON:-$REPO_ROOT/.venv/bin/python}"
DTYPE="${DTYPE:-float32}"

if [ "${CI:-}" = "true" ]; then
  echo "check-vllm-cuda.sh needs a GPU machine; not run in CI" >&2; exit 0
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 \
  || { echo "FAIL no NVIDIA GPU visible (nvidia-smi -L)"; exit 1; }
[ -x "$PROJECT_PY" ] || { echo "FAIL no project Python at $PROJECT_PY (run scripts/setup.sh)"; exit 1; }

stamp="$VENV/.posttrain-vllm-cuda-installed"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$PIN" ]; then
  t0="$(date +%s)"
  [ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q "$PIN"
  echo "$PIN" >"$stamp"
  echo "vLLM venv $VENV: $PIN installed in $(($(date +%s) - t0))s"
fi
"$VENV/bin/python" - <<'PY' || { echo "FAIL vLLM's venv has no CUDA torch"; exit 1; }
import torch, vllm
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print(f"PASS vllm {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
PY

cd "$REPO_ROOT"
exec env PYTHONPATH="$REPO_ROOT" HF_HUB_OFFLINE=1 "$PROJECT_PY" scripts/gpu/check_vllm_cuda.py \
  --engine-python "$VENV/bin/python" --dtype "$DTYPE" "$@"
