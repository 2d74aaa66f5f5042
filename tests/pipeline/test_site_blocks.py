"""``posttrain blocks save --from FILE``: a site's blocks from one YAML file, secrets named by
environment variable; examples/blocks.yaml is valid and has every field a site must set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from posttrain.cluster import KubernetesConfig, SlurmConfig
from posttrain.pipeline.blocks import InferenceDeployment, ObjectStore
from posttrain.pipeline.deployments.site_blocks import BlocksFileError, load_blocks_file

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "blocks.yaml"
SECRETS = {"CW_ACCESS_KEY_ID": "AKIAEXAMPLEKEY123456", "CW_SECRET_ACCESS_KEY": "wJalrXUtnFEMI-example-secret",
           "POSTTRAIN_GATEWAY_TOKEN": "gateway-token-0123456789", "POSTTRAIN_PROD_GATEWAY_TOKEN": "prod-token-9876543210"}


def _write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "blocks.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def test_the_example_file_is_valid_and_reads_its_secrets_from_the_environment():
    blocks = {b.ref: b.block for b in load_blocks_file(EXAMPLE, SECRETS)}
    assert set(blocks) == {"posttrain-slurm-cluster/default", "posttrain-kubernetes-cluster/default",
                           "posttrain-local-cluster/default", "posttrain-object-store/default",
                           "posttrain-inference-deployment/default", "posttrain-inference-deployment/production"}
    assert isinstance(blocks["posttrain-slurm-cluster/default"].settings, SlurmConfig)
    assert isinstance(blocks["posttrain-kubernetes-cluster/default"].settings, KubernetesConfig)
    store = blocks["posttrain-object-store/default"]
    assert isinstance(store, ObjectStore)
    assert store.secret_access_key.get_secret_value() == SECRETS["CW_SECRET_ACCESS_KEY"]
    inference = blocks["posttrain-inference-deployment/default"]
    assert isinstance(inference, InferenceDeployment)
    assert inference.token.get_secret_value() == SECRETS["POSTTRAIN_GATEWAY_TOKEN"]
    # a posttrain serve gateway takes its hot-loads at its own URL, not CoreWeave's default
    assert inference.api_url == inference.gateway_url
    production = blocks["posttrain-inference-deployment/production"]  # the promote deployment's default
    assert production.token.get_secret_value() == SECRETS["POSTTRAIN_PROD_GATEWAY_TOKEN"]
    assert production.deployment_id != inference.deployment_id  # its history is its own


def test_the_example_sets_every_field_a_site_must_set():
    example = _example()
    for ref, fields in example.items():
        cls = type(load_blocks_file(EXAMPLE, SECRETS)[list(example).index(ref)].block)
        settings = getattr(cls.model_fields.get("settings"), "annotation", None)
        model, given = (settings, fields["settings"]) if settings else (cls, fields)
        required = {n for n, f in model.model_fields.items() if f.is_required()}
        assert required <= set(given), f"{ref} leaves out {required - set(given)}"
    assert "api_url" in example["posttrain-inference-deployment/default"]


@pytest.mark.parametrize(("change", "message"), [
    ({"posttrain-object-store/default": {"uri": "s3://b/p", "secret_access_key": "wJalrXUtnFEMI-literal"}},
     "posttrain-object-store/default: secret_access_key: a secret; give the environment variable"),
    ({"posttrain-object-store/default": {"uri": "s3://b/p", "access_key_id": {"env": "NOT_SET_HERE"}}},
     "access_key_id: environment variable NOT_SET_HERE is not set"),
    ({"posttrain-object-store/default": {"uri": "s3://b/p", "urii": "x"}}, "urii: not a field of posttrain-object-store"),
    ({"posttrain-inference-deployment/default": {"gateway_url": "http://g:8000", "deployment_id": "d",
                                                 "model": "m", "token": {"env": "POSTTRAIN_GATEWAY_TOKEN"}}},
     "posttrain-inference-deployment/default: api_url: set it explicitly"),
    ({"posttrain-slurm-cluster/default": {"settings": {"shared_dir": "/mnt/shared", "nodes": 0}}},
     "posttrain-slurm-cluster/default: settings.nodes: "),
    ({"posttrain-slurm-cluster/default": {"settings": {"partition": "h100"}}},
     "posttrain-slurm-cluster/default: settings.shared_dir: Field required"),
    ({"posttrain-slurm/default": {}}, "'posttrain-slurm/default' is not <block type>/<name>"),
    ({"posttrain-local-cluster": {}}, "is not <block type>/<name>"),
])  # fmt: skip
def test_a_bad_block_is_one_line_naming_the_block_and_field(tmp_path, change, message):
    path = _write(tmp_path, change)
    with pytest.raises(BlocksFileError) as info:
        load_blocks_file(path, SECRETS)
    text = str(info.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text
    assert "literal" not in text  # a secret given in the file is never echoed


PLANTED = "pl4nted-cred-7f3a"
_GATEWAY = {"api_url": "http://g:8000", "gateway_url": "http://g:8000", "deployment_id": "d", "model": "m",
            "token": {"env": "POSTTRAIN_GATEWAY_TOKEN"}}
_CKS = {"namespace": "tenant", "image": "registry.example.com/posttrain:1", "pvc": "shared"}


@pytest.mark.parametrize(("ref", "field", "fields"), [
    *[("posttrain-inference-deployment/prod", f, {**_GATEWAY, f: url}) for f in ("api_url", "gateway_url")
      for url in (f"https://ops:{PLANTED}@gw.example.com", f"https://gw.example.com/?api_key={PLANTED}")],
    ("posttrain-object-store/default", "endpoint_url", {"uri": "s3://b/p", "endpoint_url": f"https://AKIA:{PLANTED}@s3.x"}),
    ("posttrain-object-store/default", "uri", {"uri": f"s3://AKIA:{PLANTED}@bucket/p"}),
    ("posttrain-object-store/default", "endpoint_url",
     {"uri": "s3://b/p", "endpoint_url": f"https://acct.blob.x.net/?sv=2022-11-02&sig={PLANTED}"}),
    ("posttrain-kubernetes-cluster/cks", "settings.object_storage.credentials_url",
     {"settings": {**_CKS, "object_storage": {"org_id": "o1", "region": "US-EAST-04A",
                                              "credentials_url": f"https://u:{PLANTED}@api.example.com/c"}}}),
])  # fmt: skip
def test_a_credential_in_any_url_field_of_a_block_is_refused_without_echoing_it(tmp_path, ref, field, fields):
    """A block's fields are stored in clear on the server and read back by anyone who can read
    blocks: a URL with a user, a password or a signed query is refused like the cluster env refuses it."""
    path = _write(tmp_path, {ref: fields})
    with pytest.raises(BlocksFileError) as info:
        load_blocks_file(path, SECRETS)
    text = str(info.value)
    assert text.startswith(f"{path}: {ref}: {field}: holds a ") and "credential" in text and "\n" not in text
    assert PLANTED not in text


def test_a_block_built_in_python_refuses_a_url_credential_without_echoing_it():
    import pydantic

    with pytest.raises(pydantic.ValidationError) as info:
        InferenceDeployment(**{**_GATEWAY, "token": "t", "gateway_url": f"https://ops:{PLANTED}@gw.example.com"})
    assert "gateway_url" in str(info.value) and PLANTED not in str(info.value)


def test_check_prints_where_each_secret_comes_from_never_its_value(tmp_path):
    env = {**os.environ, **SECRETS, "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # --check contacts no server
    run = subprocess.run([sys.executable, "-m", "posttrain", "blocks", "save", "--from", str(EXAMPLE), "--check"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "valid: posttrain-inference-deployment/default (token from $POSTTRAIN_GATEWAY_TOKEN)" in run.stdout
    assert not any(v in run.stdout + run.stderr for v in SECRETS.values())


def test_a_missing_variable_is_one_line_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    run = subprocess.run([sys.executable, "-m", "posttrain", "blocks", "save", "--from", str(EXAMPLE), "--check"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip() == (f"posttrain: error: {EXAMPLE}: posttrain-object-store/default: access_key_id: "
                                  "environment variable CW_ACCESS_KEY_ID is not set")


def test_blocks_save_stores_every_block_of_the_example(prefect_api, tmp_path):
    """Against a real server, under names of its own (the flow tests use the default blocks)."""
    from prefect.blocks.core import Block

    example = {ref.replace("/default", "/site-setup-test"): fields for ref, fields in _example().items()}
    path = _write(tmp_path, example)
    env = {**os.environ, **SECRETS}
    run = subprocess.run([sys.executable, "-m", "posttrain", "blocks", "save", "--from", str(path)], env=env,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("saved: ") == len(example)
    assert not any(v in run.stdout + run.stderr for v in SECRETS.values())
    import posttrain.pipeline.blocks  # noqa: F401 - registers the block classes for Block.load

    slurm = Block.load("posttrain-slurm-cluster/site-setup-test")
    assert slurm.settings.partition == "h100" and slurm.settings.image is None
    inference = Block.load("posttrain-inference-deployment/site-setup-test")
    assert inference.api_url == "http://gateway-host:8000"
    assert inference.token.get_secret_value() == SECRETS["POSTTRAIN_GATEWAY_TOKEN"]
    store = Block.load("posttrain-object-store/site-setup-test")
    assert store.access_key_id.get_secret_value() == SECRETS["CW_ACCESS_KEY_ID"]
