"""Other engines behind the ``HotLoader`` seam: SGLang and vLLM (stubs with the plan).

Neither speaks the CoreWeave contract; both load a *plain checkpoint folder* they can read.
So the adapter does the consumer's side of the chain itself: download the snapshots that the
identity needs (``posttrain.inference.snapshot_fetch.SnapshotSource``), rebuild the version
with ``posttrain.chain.ops.reconstruct(..., held_dir=<the version the engine holds>)`` into a
folder every engine worker can read, then ask the engine to load it. Both raise
NotImplementedError until an engine is available to test against.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.inference.weight_loader import HotLoadResult, PublishFull


class SGLangDiskLoader:
    """SGLang's ``POST /update_weights_from_disk`` (sgl-project/sglang, docs sglang_for_rl.md).

    Plan: reconstruct into ``shared_dir/<identity>``; ``POST /pause_generation {"mode": "retract"}``;
    ``POST /update_weights_from_disk {"model_path": ..., "weight_version": identity,
    "flush_cache": true}`` (the reply has ``success`` and ``message``; a failure leaves the old
    weights); ``POST /continue_generation``; check ``GET /get_weight_version`` == identity. One
    server per call: with several replicas behind a router, call each and report each as a
    replica. The fallback to a full snapshot is the same as CoreWeave's.
    """

    def __init__(self, base_url: str, shared_dir: Path, *, token: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.shared_dir = Path(shared_dir)
        self._token = token

    def hot_load(self, identity: str, *, base_identity: str | None = None,
                 publish_full: PublishFull | None = None) -> HotLoadResult:
        raise NotImplementedError("SGLang hot-loading is planned (see the class notes); use posttrain serve "
                                  "or a CoreWeave deployment")


class VLLMWeightTransferLoader:
    """vLLM's native weight transfer, ``disk`` backend (vllm docs/training/weight_transfer).

    Plan (server started with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config
    '{"backend": "disk"}'``): reconstruct into a folder visible to all workers;
    ``POST /pause?mode=wait`` (or ``keep`` to record per-token ``weight_versions``);
    ``init_weight_transfer_engine`` -> ``start_weight_update`` -> ``update_weights({"path": ...})``
    -> ``finish_weight_update`` with ``weight_version=identity``; ``POST /resume``; confirm with
    ``GET /weight_info``. The disk backend is not transactional: on a failed update, load the
    previous folder again before resuming.
    """

    def __init__(self, base_url: str, shared_dir: Path, *, token: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.shared_dir = Path(shared_dir)
        self._token = token

    def hot_load(self, identity: str, *, base_identity: str | None = None,
                 publish_full: PublishFull | None = None) -> HotLoadResult:
        raise NotImplementedError("vLLM weight transfer is planned (see the class notes); use posttrain serve "
                                  "or a CoreWeave deployment")
