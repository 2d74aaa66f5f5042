"""The embedded defaults: this machine as the cluster, a folder as the store, the reference server.

``save_default_blocks`` saves the blocks that the flows' default settings name, so a flow run on
a fresh Prefect server works with no further setup.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr

DEFAULT = "default"


def save_default_blocks(*, store_dir: Path, server_url: str | None, deployment_id: str, model: str,
                        token: SecretStr | str | None) -> None:
    from posttrain.pipeline.blocks import InferenceDeployment, LocalCluster, ObjectStore

    LocalCluster().save(DEFAULT, overwrite=True)
    ObjectStore(uri=str(store_dir)).save(DEFAULT, overwrite=True)
    if server_url is not None:
        InferenceDeployment(api_url=server_url, gateway_url=server_url, deployment_id=deployment_id, model=model,
                            token=token, timeout_s=300, poll_interval_s=0.2).save(DEFAULT, overwrite=True)
