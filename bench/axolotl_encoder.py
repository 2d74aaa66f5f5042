"""Axolotl 0.21's own delta encoder, run from its unpacked wheel, for the benchmark.

    python bench/axolotl_encoder.py WHEEL_DIR NEW_DIR BASE_DIR OUT_DIR

Imports ``axolotl/utils/delta_checkpoint.py`` by file path (not the ``axolotl`` package, whose
``__init__`` pulls in its whole dependency tree), loads both checkpoints the way its CoreWeave
plugin's ``load_weights`` does (``safetensors.torch.load_file`` per shard), and calls
``write_checkpoint(new, out, base=base, ...)``: what its publisher runs for a delta. The
publisher's extra ``snapshot_weights`` copy of the new weights is left out, to Axolotl's
advantage. Needs torch, numpy, safetensors and zstandard, which posttrain's environment has.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

MODULE = "axolotl/utils/delta_checkpoint.py"


def fetch(dest: Path) -> Path | str:
    """Download and unpack the 0.21.0 wheel under ``dest``; the unpacked folder, or why not."""
    import subprocess
    import zipfile

    unpacked = dest / "unpacked"
    if (unpacked / MODULE).is_file():
        return unpacked
    dest.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--python-version", "3.12", "axolotl==0.21.0", "-d", str(dest)],
                              capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        return f"pip download failed ({e})"
    wheels = sorted(dest.glob("axolotl-0.21.0-*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return f"pip download failed: {lines[-1] if lines else 'no wheel'}"
    with zipfile.ZipFile(wheels[0]) as z:
        z.extract(MODULE, unpacked)
    return unpacked


def load_module(wheel_dir: Path):
    spec = importlib.util.spec_from_file_location("axolotl_delta_checkpoint", wheel_dir / MODULE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_weights(directory: Path) -> dict:
    """As axolotl.integrations.coreweave.plugin.load_weights (which imports transformers)."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    weights: dict = {}
    for f in files:
        weights.update(load_file(directory / f))
    return weights


def main() -> None:
    wheel_dir, new_dir, base_dir, out = map(Path, sys.argv[1:5])
    mod = load_module(wheel_dir)
    base = load_weights(base_dir)
    new = load_weights(new_dir)
    mod.write_checkpoint(new, out, identity="new", base=base, base_identity="base")


if __name__ == "__main__":
    main()
