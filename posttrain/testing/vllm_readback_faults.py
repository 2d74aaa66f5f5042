"""A vLLM worker extension that reloads wrongly on request: the failures the readback must catch.

Tests only. vLLM imports it as ``posttrain_readback_faults`` (a copy on its PYTHONPATH beside
``posttrain_readback``, the real extension, which it subclasses), so like that one it imports
nothing of posttrain. The next in-place reload misbehaves as the JSON file named by
``$POSTTRAIN_TEST_READBACK_FAULT`` says, once (the file is removed when read):

- ``{"mode": "drop", "tensor": NAME}``: the loader skips NAME (it keeps its old value; prime-rl #2714);
- ``{"mode": "cached"}``: the loader re-serves the weights it read last instead of the folder's
  (vLLM #32718);
- ``{"mode": "ignore"}``: the loader reads the folder, but the model takes none of it: the engine
  stays on the previous version while everything it read was right.
"""

from __future__ import annotations

import json
import os

try:  # in vLLM's venv, beside the real extension
    from posttrain_readback import WeightReadback, describe  # type: ignore[import-not-found]
except ImportError:  # imported from posttrain itself (the tests read FAULT_ENV and CLS)
    from posttrain.serve.readback_extension import WeightReadback, describe

FAULT_ENV = "POSTTRAIN_TEST_READBACK_FAULT"
MODULE = "posttrain_readback_faults"
CLS = f"{MODULE}.FaultyReadback"


def _take_fault() -> dict:
    path = os.environ.get(FAULT_ENV)
    if not path or not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        fault = json.load(f)
    os.remove(path)
    return fault


class FaultyReadback(WeightReadback):
    def _posttrain_source(self, weights_path: str):
        fault = self.__dict__.pop("_posttrain_fault", {})
        previous = getattr(self, "_posttrain_last_path", None) or str(self.vllm_config.model_config.model)
        self._posttrain_last_path = weights_path
        if fault.get("mode") == "cached":
            yield from super()._posttrain_source(previous)  # the loader reads the folder lazily: after it, not before
            self.vllm_config.model_config.model = weights_path  # it says it loaded the new folder
            return
        for name, tensor in super()._posttrain_source(weights_path):
            if fault.get("mode") == "drop" and name == fault.get("tensor"):
                continue
            yield name, tensor

    def posttrain_reload(self, weights_path: str, identity: str) -> dict:
        self._posttrain_fault = _take_fault()
        if self._posttrain_fault.get("mode") != "ignore":
            return super().posttrain_reload(weights_path, identity)
        consumed = {name: describe(t) for name, t in self._posttrain_source(weights_path)}
        self._posttrain_identity = identity
        return {"consumed": consumed, "dtype": str(self.vllm_config.model_config.dtype).removeprefix("torch.")}
