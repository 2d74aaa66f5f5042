"""The baseline: the known producer's algorithm, as Axolotl 0.21 writes it.

Loads both checkpoints whole into memory, then XORs, compresses (zstd level 1, one-shot) and
checksums each tensor on one thread, and saves the delta shard with safetensors. Used only by
the benchmark, to measure posttrain against in the same run.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path


def load_whole(path: Path) -> dict:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(path / f))
    return out


def encode(new_dir: Path, base_dir: Path, out_dir: Path) -> None:
    import numpy as np
    import zstandard
    from safetensors.numpy import save_file

    new, base = load_whole(new_dir), load_whole(base_dir)
    cctx = zstandard.ZstdCompressor(level=1)
    tensors, checksums = {}, {}
    for name, t in new.items():
        cur = t.contiguous().reshape(-1).view(dtype=__import__("torch").uint8).numpy()
        old = base[name].contiguous().reshape(-1).view(dtype=__import__("torch").uint8).numpy()
        delta = np.bitwise_xor(cur, old)
        if not delta.any():
            continue
        tensors[name] = np.frombuffer(cctx.compress(delta.tobytes()), dtype=np.uint8)
        checksums[name] = "%08x" % zlib.adler32(cur.tobytes())
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "model-00000.safetensors"), metadata=checksums)
    index = {"metadata": {"version": "new", "base_version": "base", "delta_encoding": "xor",
                          "compression_format": "zstd", "checksum_format": "adler32"},
             "weight_map": {n: "model-00000.safetensors" for n in tensors}}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index))


def apply(base_dir: Path, delta_dir: Path, out_dir: Path) -> None:
    import numpy as np
    import torch
    import zstandard
    from safetensors import safe_open
    from safetensors.torch import save_file

    state = load_whole(base_dir)
    dctx = zstandard.ZstdDecompressor()
    index = json.loads((delta_dir / "model.safetensors.index.json").read_text())
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(delta_dir / fname, framework="numpy") as f:
            meta = f.metadata()
            for name in f.keys():
                delta = np.frombuffer(dctx.decompress(f.get_tensor(name).tobytes()), dtype=np.uint8)
                t = state[name].contiguous()
                cur = t.reshape(-1).view(torch.uint8).numpy()
                new = np.bitwise_xor(cur, delta)
                if "%08x" % zlib.adler32(new.tobytes()) != meta[name]:
                    raise SystemExit(f"checksum mismatch for {name}")
                state[name] = torch.from_numpy(new).view(t.dtype).reshape(t.shape)
    out_dir.mkdir(parents=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    op, *paths = sys.argv[1:]
    {"encode": encode, "apply": apply}[op](*map(Path, paths))
