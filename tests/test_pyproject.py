"""The package's metadata as setuptools reads it: no deprecation warning on install."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_the_license_is_an_spdx_string_that_setuptools_reads_without_a_warning():
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    config = tomllib.loads(PYPROJECT.read_text())
    assert config["project"]["license"] == "Apache-2.0"  # the table { text = ... } is deprecated
    assert "setuptools>=77" in config["build-system"]["requires"]  # PEP 639 strings: setuptools 77 on
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), PYPROJECT)
    assert not [w for w in caught if "license" in str(w.message).lower()], [str(w.message) for w in caught]
    assert dist.metadata.license_expression == "Apache-2.0"
