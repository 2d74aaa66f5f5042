#!/usr/bin/env bash
# Headless Chromium for the test of the Prefect UI's run form (tests/pipeline/test_ui_form.py) and
# scripts/ui-screenshots.sh: Debian's `chromium` and a font, apt-installed when missing (needs root).
# Idempotent; prints "CHROMIUM <path>" on its last line.
set -euo pipefail
if ! command -v chromium >/dev/null; then
  echo "[setup-chromium] apt-get install chromium fonts-dejavu-core" >&2
  export DEBIAN_FRONTEND=noninteractive
  [ -n "$(ls /var/lib/apt/lists/ 2>/dev/null | grep -v -e '^lock$' -e '^partial$' -e '^auxfiles$')" ] \
    || apt-get update -qq
  # stale package lists (404s): update, then retry once
  apt-get install -y -qq chromium fonts-dejavu-core >/dev/null \
    || { apt-get update -qq && apt-get install -y -qq chromium fonts-dejavu-core >/dev/null; }
fi
echo "CHROMIUM $(command -v chromium)"
