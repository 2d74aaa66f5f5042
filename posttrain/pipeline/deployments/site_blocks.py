"""The blocks a site saves, from one YAML file: ``posttrain blocks save --from blocks.yaml``.

Prefect has no command that fills a block's fields, and a Python script per site is where the
inference block's ``api_url`` got left out (its default is CoreWeave's control plane, wrong for a
``posttrain serve`` gateway). The file maps ``<block type>/<name>`` (as the flows' parameters name
blocks) to the block's fields::

    posttrain-object-store/default:
      uri: s3://checkpoints/training
      access_key_id: {env: CW_ACCESS_KEY_ID}

A secret field (a ``SecretStr``: S3 keys, the inference token) is only ever given as
``{env: NAME}``, the environment variable that holds it when the command runs; a literal value is
refused, so the file can be committed. ``examples/blocks.yaml`` has every field a site sets.
"""

from __future__ import annotations

import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prefect.blocks.core import Block
from pydantic import SecretStr, ValidationError

from posttrain.errors import describe_validation_error
from posttrain.pipeline.blocks import InferenceDeployment, KubernetesCluster, LocalCluster, ObjectStore, SlurmCluster

BLOCK_TYPES: dict[str, type[Block]] = {
    cls.get_block_type_slug(): cls
    for cls in (SlurmCluster, KubernetesCluster, LocalCluster, ObjectStore, InferenceDeployment)
}
# Fields the file must set although the block has a default: a default that is right for one kind
# of site only. api_url defaults to CoreWeave's control plane; a posttrain serve gateway takes its
# hot-loads at its own URL (the gateway_url).
MUST_SET = {InferenceDeployment.get_block_type_slug(): {
    "api_url": "the hot-load control plane: the gateway's URL (= gateway_url) for a posttrain serve gateway, "
               "https://api.coreweave.com for a CoreWeave deployment",
}}
_NAME = re.compile(r"^[0-9A-Za-z][-0-9A-Za-z_.]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class BlocksFileError(ValueError):
    """A bad blocks file: one line naming the file, the block and the field."""


@dataclass
class SiteBlock:
    ref: str  # <block type>/<name>
    block: Block
    from_env: dict[str, str]  # field -> the environment variable its value came from

    @property
    def name(self) -> str:
        return self.ref.split("/", 1)[1]


def _is_secret(annotation: Any) -> bool:
    if annotation is SecretStr:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_secret(a) for a in typing.get_args(annotation))
    return False


def secret_fields(cls: type[Block]) -> set[str]:
    return {name for name, f in cls.model_fields.items() if _is_secret(f.annotation)}


def _env_ref(value: Any) -> str | None:
    """NAME for a ``{env: NAME}`` value, else None."""
    if isinstance(value, dict) and set(value) == {"env"}:
        return value["env"] if isinstance(value["env"], str) else ""
    return None


def parse_block(where: str, ref: str, fields: Any, environ: dict[str, str]) -> SiteBlock:
    slug, _, name = ref.partition("/")
    if slug not in BLOCK_TYPES or not _NAME.fullmatch(name):
        raise BlocksFileError(f"{where}: {ref!r} is not <block type>/<name> with a block type of "
                              f"{', '.join(BLOCK_TYPES)}")
    where = f"{where}: {ref}"
    cls = BLOCK_TYPES[slug]
    fields = {} if fields is None else fields
    if not isinstance(fields, dict):
        raise BlocksFileError(f"{where}: expected a mapping of the block's fields")
    known = set(cls.model_fields)
    unknown = sorted(str(k) for k in fields if k not in known)
    if unknown:
        raise BlocksFileError(f"{where}: {unknown[0]}: not a field of {slug} (its fields: {', '.join(sorted(known))})")
    for field, why in MUST_SET.get(slug, {}).items():
        if field not in fields:
            raise BlocksFileError(f"{where}: {field}: set it explicitly: {why}")
    secrets = secret_fields(cls)
    values, from_env = {}, {}
    for field, value in fields.items():
        env = _env_ref(value)
        if env is None:
            if field in secrets and value is not None:  # never echo the value: it may be the secret
                raise BlocksFileError(f"{where}: {field}: a secret; give the environment variable that holds it, "
                                      f"{field}: {{env: NAME}}, never the value")
            values[field] = value
            continue
        if not _ENV_NAME.fullmatch(env):
            raise BlocksFileError(f"{where}: {field}: {{env: NAME}} needs an environment variable name, not {env!r}")
        if not environ.get(env):
            raise BlocksFileError(f"{where}: {field}: environment variable {env} is not set")
        values[field], from_env[field] = environ[env], env
    try:
        block = cls.model_validate(values)
    except ValidationError as e:
        raise BlocksFileError(f"{where}: {describe_validation_error(e)}") from None
    return SiteBlock(ref, block, from_env)


def load_blocks_file(path: str | os.PathLike[str], environ: dict[str, str] | None = None) -> list[SiteBlock]:
    """Every block of the file, validated, secrets read from ``environ`` (default: os.environ)."""
    environ = dict(os.environ if environ is None else environ)
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise BlocksFileError(f"{path}: {' '.join(str(e).split())}") from None
    if not isinstance(doc, dict) or not doc:
        raise BlocksFileError(f"{path}: expected a mapping of <block type>/<name> to the block's fields")
    return [parse_block(str(path), str(ref), fields, environ) for ref, fields in doc.items()]


def describe(site: SiteBlock) -> str:
    """One line per block for the command's output: where each secret came from, never its value."""
    secrets = sorted(secret_fields(type(site.block)))
    shown = [f"{f} from ${site.from_env[f]}" if f in site.from_env else f"{f} unset" for f in secrets
             if f in site.from_env or getattr(site.block, f) is None]
    return site.ref + (f" ({', '.join(shown)})" if shown else "")


def save_blocks(blocks: list[SiteBlock]) -> list[str]:
    """Save (overwrite) every block on the Prefect server of PREFECT_API_URL."""
    from posttrain.pipeline.deployments.setup import register_blocks

    register_blocks()
    for site in blocks:
        site.block.save(site.name, overwrite=True)
    return [describe(site) for site in blocks]
