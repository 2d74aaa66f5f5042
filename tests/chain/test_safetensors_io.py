"""The streaming writer lays files out byte for byte as the safetensors library does."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save as np_save
from safetensors.torch import save as torch_save

from posttrain.chain.safetensors_io import TensorSpec, layout_file, read_header
from tests.support.tensors import TORCH_DTYPES, random_tensor, tensor_bytes

ALL_DTYPES = {**TORCH_DTYPES, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16, "U32": torch.uint32,
              "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def our_bytes(tensors: dict[str, tuple[str, tuple[int, ...], bytes]], metadata) -> bytes:
    layout = layout_file([TensorSpec(n, d, s, len(b)) for n, (d, s, b) in tensors.items()], metadata)
    return layout.header + b"".join(tensors[s.name][2] for s in layout.order)


@settings(max_examples=60, deadline=None)
@given(
    specs=st.dictionaries(st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=10),
                          st.tuples(st.sampled_from(sorted(ALL_DTYPES)),
                                    st.lists(st.integers(0, 4), max_size=3).map(tuple)),
                          min_size=1, max_size=8),
    seed=st.integers(0, 1000),
)
def test_layout_matches_safetensors_torch(specs, seed):
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (dtype, shape) in specs.items():
        if dtype in TORCH_DTYPES:
            t = random_tensor(rng, dtype, shape)
        else:
            n = int(np.prod(shape)) if shape else 1
            raw = torch.from_numpy(rng.integers(0, 256, n * ALL_DTYPES[dtype].itemsize, dtype=np.uint8))
            t = raw.view(ALL_DTYPES[dtype]).reshape(shape) if n else torch.empty(shape, dtype=ALL_DTYPES[dtype])
        tensors[name] = t
    expected = torch_save(tensors, metadata={"format": "pt"})
    ours = our_bytes({n: (d, tuple(tensors[n].shape), tensor_bytes(tensors[n])) for n, (d, _) in specs.items()},
                     {"format": "pt"})
    assert ours == expected


def test_delta_shard_layout_matches_safetensors_numpy():
    rng = np.random.default_rng(0)
    frames = {f"model.layers.{i}.w": rng.integers(0, 256, int(rng.integers(0, 50)), dtype=np.uint8)
              for i in range(12)}
    one_key = {"model.layers.3.w": "0123abcd"}
    expected = np_save(frames, metadata=one_key)
    ours = our_bytes({n: ("U8", a.shape, a.tobytes()) for n, a in frames.items()}, one_key)
    assert ours == expected


def test_read_header_round_trips(tmp_path):
    data = torch_save({"a": torch.zeros(3, 2, dtype=torch.bfloat16), "b": torch.ones((), dtype=torch.int64)},
                      metadata={"format": "pt"})
    (tmp_path / "x.safetensors").write_bytes(data)
    h = read_header(tmp_path / "x.safetensors")
    assert h.metadata == {"format": "pt"}
    assert {n: (t.dtype, t.shape, t.nbytes) for n, t in h.tensors.items()} == {
        "a": ("BF16", (3, 2), 12), "b": ("I64", (), 8)}
