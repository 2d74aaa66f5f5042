#!/usr/bin/env bash
# Screenshots of the Prefect UI showing a posttrain demo run, to look at what a person sees.
#
#   bash scripts/ui-screenshots.sh [OUT_DIR]
#
# Starts a Prefect server with its UI on a non-default port in a state folder of its own
# (scripts/services/start-prefect.sh), runs `posttrain demo` against it (a nightly pass and GRPO
# rounds: table, progress, markdown and reward-curve (inline SVG) artifacts), then takes screenshots with
# headless Chromium (Debian's `chromium`; installed with apt-get when missing, needs root) of the
# GRPO and nightly flow run pages, the artifacts page and each artifact's page. Writes PNGs, the
# reward curve's SVG and artifacts.json (every artifact of the two runs, as the API lists them:
# key, type, data) to OUT_DIR (default: a new folder under /tmp) and prints it. Stops the
# server at the end if it started it (KEEP=1 leaves it running).
#
#   UI_PORT                 (default 4513) the server's port
#   POSTTRAIN_PREFECT_DIR   (default $POSTTRAIN_SERVICES_DIR/prefect-ui) the server's state folder
#   POSTTRAIN_BIN_DIR       (default <repo>/.venv/bin) the Python that has posttrain and prefect
#   WINDOW                  (default 1440,1000) the browser window, width,height
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/services/lib.sh
PORT="${UI_PORT:-4513}"
export POSTTRAIN_PREFECT_DIR="${POSTTRAIN_PREFECT_DIR:-$SERVICES_DIR/prefect-ui}"
export PREFECT_PORT="$PORT" PREFECT_UI=1 POSTTRAIN_BIN_DIR="$BIN_DIR"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
export PREFECT_API_URL="http://127.0.0.1:$PORT/api"
UI="http://127.0.0.1:$PORT"
OUT="${1:-$(mktemp -d /tmp/posttrain-ui-XXXXXX)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WINDOW="${WINDOW:-1440,1000}"

if ! command -v chromium >/dev/null; then
  echo "installing chromium (apt-get)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
fi

started=0
pid_alive "$POSTTRAIN_PREFECT_DIR/server.pid" prefect || started=1
bash scripts/services/start-prefect.sh
stop() { [ "$started" = 1 ] && [ "${KEEP:-0}" != 1 ] && bash scripts/services/stop-prefect.sh; true; }
trap stop EXIT

echo "running posttrain demo against $PREFECT_API_URL (log: $OUT/demo.log)"
"$PYTHON" -m posttrain demo --workdir "$OUT/demo" --steps 3 --rounds 3 >"$OUT/demo.log" 2>&1 \
  || { tail -40 "$OUT/demo.log" >&2; exit 1; }

# The newest GRPO and nightly flow runs, their artifacts (artifacts.json), the pages to capture.
"$PYTHON" - "$PREFECT_API_URL" "$UI" "$OUT" >"$OUT/pages.txt" <<'EOF'
import json, re, sys, urllib.request
api, ui, out = sys.argv[1:4]

def post(path, body):
    req = urllib.request.Request(api + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())

flows = {f["id"]: f["name"] for f in post("/flows/filter", {})}
runs = post("/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 50})
newest = {}
for run in runs:
    newest.setdefault(flows.get(run["flow_id"]), run)
pages, found = [], []
for flow, slug in (("grpo", "grpo"), ("nightly-post-training", "nightly")):
    run = newest.get(flow)
    if run is None:
        sys.exit(f"no {flow} flow run found")
    # (the run page's Artifacts tab cannot be opened by URL: the UI resets ?tab= while it loads)
    pages.append((f"flow-run-{slug}", f"{ui}/runs/flow-run/{run['id']}"))
    arts = post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}, "sort": "KEY_ASC"})
    for a in arts:
        data = a["data"] if isinstance(a["data"], str) else json.dumps(a["data"])
        found.append({"flow": flow, "flow_run": run["name"], "id": a["id"], "key": a["key"], "type": a["type"],
                      "description": a["description"], "task_run_id": a["task_run_id"],
                      "data": data if len(data) <= 300 else data[:300] + "..."})
        name = f"artifact-{slug}-{a['key'] or 'unkeyed-' + str(a['type']) + '-' + a['id'][:8]}"
        pages.append((name, f"{ui}/artifacts/artifact/{a['id']}"))
        svg = re.search(r"data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)", str(a["data"]))
        if svg:  # the reward curve: a markdown artifact with the SVG inline
            import base64
            with open(f"{out}/{a['key']}.svg", "wb") as f:
                f.write(base64.b64decode(svg.group(1)))
pages.append(("artifacts", f"{ui}/artifacts"))
with open(f"{out}/artifacts.json", "w") as f:
    json.dump(found, f, indent=1)
for a in found:
    print(f"# {a['flow']:22} key={a['key']!s:28} type={a['type']!s:9} task_run={a['task_run_id']} "
          f"{a['data'][:60]!r}", file=sys.stderr)
for name, url in pages:
    print(name, url)
EOF

shot() {  # shot NAME URL
  timeout 120 chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --force-device-scale-factor=1 \
    --window-size="$WINDOW" --virtual-time-budget=15000 --screenshot="$OUT/$1.png" "$2" >/dev/null 2>&1 \
    || echo "chromium failed on $2" >&2
  [ -s "$OUT/$1.png" ] && echo "  $1.png  $2"
}
echo "screenshots:"
while read -r name url; do shot "$name" "$url"; done <"$OUT/pages.txt"
for svg in "$OUT"/*.svg; do
  [ -e "$svg" ] && WINDOW=500,280 shot "$(basename "$svg" .svg)-svg" "file://$svg"
done
echo "UI SCREENSHOTS in $OUT"
