"""``S3StoreConfig``: where an S3Store lives and how it talks to it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from posttrain.storage.keys import check_key

MiB = 1024 * 1024


class S3StoreConfig(BaseModel):
    """Settings of an S3 or S3-compatible store (AWS, CoreWeave, SeaweedFS, moto)."""

    # hide_input_in_errors: a mistyped field name must not echo a secret into the error
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    bucket: str = Field(
        description="Bucket name (3-63 characters: lowercase letters, digits, '.', '-').",
        pattern=r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$",
    )
    prefix: str = Field(
        "",
        description="Folder-like prefix inside the bucket under which all keys live; '' for the root.",
    )
    endpoint_url: str | None = Field(
        None,
        description="S3 endpoint, e.g. http://127.0.0.1:8333 or https://cwobject.com. None: boto3 "
        "resolves it (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile, else AWS).",
    )
    region: str | None = Field(
        None, description="Region used for signing. None: AWS_REGION/AWS_DEFAULT_REGION or the profile."
    )
    profile: str | None = Field(
        None, description="Profile of ~/.aws/config and ~/.aws/credentials to use. None: the default chain."
    )
    access_key_id: SecretStr | None = Field(
        None, description="Access key id. None: from the environment or profile (the default chain)."
    )
    secret_access_key: SecretStr | None = Field(
        None, description="Secret access key, given together with access_key_id."
    )
    session_token: SecretStr | None = Field(
        None, description="Session token of temporary credentials, with access_key_id."
    )
    addressing_style: Literal["path", "virtual", "auto"] = Field(
        "auto",
        description="'path' (http://host/bucket/key, usual for local servers), 'virtual' "
        "(http://bucket.host/key) or 'auto' (boto3 decides).",
    )
    part_size: int = Field(
        64 * MiB,
        ge=5 * MiB,
        le=5 * 1024 * MiB,
        description="Bytes per multipart part and per ranged GET; files above it go in parts. "
        "S3 needs >= 5 MiB; CoreWeave advises >= 50 MB parts.",
    )
    max_concurrency: int = Field(
        8, ge=1, le=512, description="Parallel part uploads or ranged downloads per file."
    )
    request_checksum_calculation: Literal["when_required", "when_supported"] = Field(
        "when_required",
        description="When boto3 adds request checksums. 'when_supported' (boto3's own default) "
        "breaks some S3-compatible stores.",
    )
    response_checksum_validation: Literal["when_required", "when_supported"] = Field(
        "when_required", description="When boto3 validates response checksums."
    )
    retry_mode: Literal["standard", "adaptive"] = Field(
        "standard",
        description="botocore retry mode; 'adaptive' also rate-limits the client after throttling.",
    )
    max_attempts: int = Field(
        8, ge=1, le=50, description="Attempts per request, the first included (as AWS_MAX_ATTEMPTS); botocore "
        "retries throttling (503 SlowDown), 5xx and connection errors with backoff."
    )
    outage_retry_s: float = Field(
        120.0, ge=0, le=3600, description="Seconds to keep retrying a request through an outage of the store "
        "(connection refused or reset, timeouts, 5xx) once botocore's own attempts are spent, with back-off "
        "(1 s doubling to 30 s); 0: botocore's attempts only."
    )
    connect_timeout: float = Field(10.0, gt=0, description="Seconds to open a connection.")
    read_timeout: float = Field(60.0, gt=0, description="Seconds to wait for data on a connection.")
    list_page_size: int = Field(
        1000, ge=1, le=1000, description="Keys per ListObjectsV2 page (S3 returns at most 1000)."
    )

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        value = value.strip("/")
        if value:
            check_key(value)
        return value

    @model_validator(mode="after")
    def _credentials(self) -> S3StoreConfig:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("give access_key_id and secret_access_key together, or neither")
        if self.session_token is not None and self.access_key_id is None:
            raise ValueError("session_token needs access_key_id and secret_access_key")
        return self

    @property
    def uri(self) -> str:
        """``s3://bucket/prefix``."""
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
