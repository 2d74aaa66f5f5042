"""The demo removes the inference blocks it saved once its servers stop: a run that named them
would hot-load into nothing (real Prefect server)."""

from __future__ import annotations

import uuid

import pytest

from posttrain.cli.demo import remove_inference_blocks
from posttrain.pipeline.blocks import InferenceDeployment, ObjectStore

pytestmark = pytest.mark.slow


def test_the_demo_removes_its_inference_blocks_and_nothing_else(prefect_api, tmp_path):
    names = [f"demo-test-{uuid.uuid4().hex[:8]}", f"demo-test-{uuid.uuid4().hex[:8]}"]
    InferenceDeployment(api_url="http://127.0.0.1:9", gateway_url="http://127.0.0.1:9", deployment_id="d",
                        model="tiny", token="t").save(names[0])
    ObjectStore(uri=str(tmp_path)).save(names[1])  # a store block of the same name stays
    try:
        assert remove_inference_blocks(names) == [names[0]]  # the second was never an inference block
        with pytest.raises(ValueError):
            InferenceDeployment.load(names[0])
        assert ObjectStore.load(names[1]).uri == str(tmp_path)
        assert remove_inference_blocks(names) == []  # gone already: nothing to do, no error
    finally:
        ObjectStore.delete(names[1])
