"""``HotLoadConfig``: where the hot-load service is, and how patiently the client talks to it."""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from posttrain.inference.protocol import CACHE_RESET_ALL, MAX_PAGE_SIZE
from posttrain.polling import MIN_POLL_S


class HotLoadConfig(BaseModel):
    """Where the hot-load service is and how patiently to talk to it."""

    model_config = ConfigDict(extra="forbid")

    api_url: str = Field(
        "https://api.coreweave.com",
        description="Base URL of the hot-load control plane (posttrain serve: http://127.0.0.1:PORT).",
    )
    deployment_id: str = Field(min_length=1, description="Id of the inference deployment to hot-load.")
    token: SecretStr = Field(
        description="Bearer token (an Inference Admin token, CW_API_TOKEN by convention); never logged."
    )
    timeout: float = Field(
        1800.0, gt=0,
        description="Seconds one hot-load may take from the call to replica convergence, waiting for an "
        "unfinished earlier hot-load of the deployment included (a fallback gets its own).",
    )
    poll_interval: float = Field(2.0, ge=MIN_POLL_S, allow_inf_nan=False,
                                 description="Seconds between polls of an operation and its replicas (at least 0.05).")
    request_timeout: float = Field(30.0, gt=0, description="Seconds one HTTP call may take.")
    max_attempts: int = Field(
        6, ge=1, description="Tries of one HTTP call (creates included) on connection errors, timeouts, 429 and 5xx."
    )
    backoff_base: float = Field(0.5, ge=0, description="Seconds before the first retry; doubles on each retry.")
    backoff_max: float = Field(30.0, ge=0, description="Longest pause between retries (before jitter).")
    replica_page_size: int = Field(
        MAX_PAGE_SIZE, ge=1, le=MAX_PAGE_SIZE, description="maxPageSize when walking an operation's replicas."
    )
    list_page_size: int = Field(
        100, ge=1, le=MAX_PAGE_SIZE, description="maxPageSize when listing the deployment's operations."
    )
    prompt_cache_policy: Literal["PROMPT_CACHE_POLICY_RESET_ALL", "PROMPT_CACHE_POLICY_PRESERVE"] = Field(
        CACHE_RESET_ALL,
        description="Prompt cache after the swap: RESET_ALL (right for RL: cached prefixes belong to the old "
        "weights) or PRESERVE (the API's default).",
    )
    fallback_to_full: bool = Field(
        True, description="When an incremental hot-load fails, publish a full snapshot (publish_full) and load it."
    )

    @field_validator("api_url")
    @classmethod
    def _api_url(cls, value: str) -> str:
        value = value.rstrip("/")
        if not re.fullmatch(r"^https?://[^/@\s]+(/\S*)?$", value):
            raise ValueError("api_url must be http(s)://host[:port][/path] with no credentials in it")
        return value

    @classmethod
    def from_env(cls, *, token_env: str = "CW_API_TOKEN", **fields: Any) -> HotLoadConfig:
        """A config whose token comes from the environment variable ``token_env``."""
        token = os.environ.get(token_env)
        if not token:
            raise ValueError(f"environment variable {token_env} is not set (the hot-load API token)")
        return cls(token=SecretStr(token), **fields)


__all__ = ["HotLoadConfig"]
