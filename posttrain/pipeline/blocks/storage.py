"""Block for the object store that holds snapshot chains."""

from __future__ import annotations

from typing import ClassVar, Literal

from prefect.blocks.core import Block
from pydantic import ConfigDict, Field, SecretStr, field_validator

from posttrain import redact


class ObjectStore(Block):
    """An S3-compatible bucket and prefix (or a local folder) holding snapshot chains."""

    _block_type_name: ClassVar[str] = "posttrain Object Store"
    _block_type_slug: ClassVar[str] = "posttrain-object-store"
    _description: ClassVar[str] = (
        "Where posttrain publishes snapshot chains: the inference deployment's hot-load bucket and prefix."
    )
    _code_example: ClassVar[str] = """
```python
from posttrain.pipeline.blocks import ObjectStore

ObjectStore(uri="s3://checkpoints/training/run-001", endpoint_url="https://cwobject.com",
            access_key_id="...", secret_access_key="...").save("caios")
```
"""

    uri: str = Field(description="s3://bucket/prefix, or a folder path for a local store.")
    endpoint_url: str | None = Field(None, description="S3 endpoint (default: AWS_ENDPOINT_URL_S3, then AWS).")
    region: str | None = Field(None, description="S3 region.")
    profile: str | None = Field(None, description="AWS profile that holds the credentials.")
    access_key_id: SecretStr | None = Field(None, description="Access key id (default: environment or profile).")
    secret_access_key: SecretStr | None = Field(None, description="Secret access key (default: environment or profile).")
    part_size: int = Field(64 << 20, ge=5 << 20, description="Multipart part size in bytes (CoreWeave: >= 50 MB).")
    max_concurrency: int = Field(8, ge=1, description="Parallel parts per transfer.")
    request_checksum_calculation: Literal["when_required", "when_supported"] = Field(
        "when_required", description="boto3 request checksums; some S3-compatible stores need when_required."
    )

    # an error about a URL must not echo it: it may hold a credential
    model_config = ConfigDict(hide_input_in_errors=True)

    @field_validator("uri", "endpoint_url")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        return redact.no_credentials(value, "give the keys as access_key_id and secret_access_key ({env: NAME}), "
                                     "or a profile")

    def open(self):
        """A ``posttrain.storage.Store`` for this bucket and prefix."""
        from posttrain.storage import open_store

        if not self.uri.startswith("s3://"):
            return open_store(self.uri)
        options = {
            "endpoint_url": self.endpoint_url, "region": self.region, "profile": self.profile,
            "access_key_id": self.access_key_id, "secret_access_key": self.secret_access_key,
            "part_size": self.part_size, "max_concurrency": self.max_concurrency,
            "request_checksum_calculation": self.request_checksum_calculation,
        }
        return open_store(self.uri, **{k: v for k, v in options.items() if v is not None})
