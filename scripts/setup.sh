#!/usr/bin/env bash
# Create or reuse the virtual environment at .venv and install posttrain into it.
# torch goes first, pinned, so pip takes the CPU wheel on disk instead of a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.posttrain-installed
want="$(cat pyproject.toml | sha1sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip show torch >/dev/null 2>&1 || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
echo "$want" > "$stamp"
