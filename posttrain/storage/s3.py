"""``S3Store``: the ``Store`` interface on S3 through boto3 (imported on first use)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from posttrain import redact
from posttrain.fsutil import atomic_path
from posttrain.storage.base import PathLike, Store
from posttrain.storage.errors import NotFound, PreconditionFailed, StorageError
from posttrain.storage.keys import check_key, check_prefix, join
from posttrain.storage.outage import retry_outage
from posttrain.storage.s3config import S3StoreConfig

if TYPE_CHECKING:
    from boto3.s3.transfer import TransferConfig

DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys
NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404"}
PRECONDITION_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
T = TypeVar("T")


class S3Store(Store):
    """Objects under ``s3://bucket/prefix``. Large files move in parallel parts through
    boto3's transfer manager; botocore retries throttling and connection errors."""

    def __init__(self, config: S3StoreConfig) -> None:
        self.config = config
        self._client: Any = None
        self._transfer: TransferConfig | None = None
        self._credentials: Any = None  # botocore's, once the client exists
        self._lock = threading.Lock()

    @property
    def uri(self) -> str:
        return self.config.uri

    def __repr__(self) -> str:
        return redact.scrub(f"S3Store({self.uri!r}, endpoint_url={self.config.endpoint_url!r})")

    # ------------------------------------------------------------------ client
    @property
    def client(self) -> Any:
        """The boto3 S3 client, created on first use (thread-safe, shared)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    def _make_client(self) -> Any:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        c = self.config

        def secret(value: Any) -> str | None:
            return value.get_secret_value() if value is not None else None

        try:
            session = boto3.session.Session(
                profile_name=c.profile,
                region_name=c.region,
                aws_access_key_id=secret(c.access_key_id),
                aws_secret_access_key=secret(c.secret_access_key),
                aws_session_token=secret(c.session_token),
            )
            client = session.client(
                "s3",
                endpoint_url=c.endpoint_url,
                config=Config(
                    s3={"addressing_style": c.addressing_style},
                    # total_max_attempts counts the first attempt, like AWS_MAX_ATTEMPTS;
                    # Config's "max_attempts" would count retries only
                    retries={"mode": c.retry_mode, "total_max_attempts": c.max_attempts},
                    request_checksum_calculation=c.request_checksum_calculation,
                    response_checksum_validation=c.response_checksum_validation,
                    connect_timeout=c.connect_timeout,
                    read_timeout=c.read_timeout,
                    # one connection per transfer thread, plus a few for other calls
                    max_pool_connections=c.max_concurrency + 4,
                    user_agent_extra="posttrain",
                ),
            )
            # what the client signs with (config, environment or profile): scrubbed from every message
            self._credentials = session.get_credentials()
            redact.remember(*self._resolved())
        except Exception as e:  # noqa: BLE001 - bad profile, region, endpoint...
            raise self._error(e, "connect to", None) from None
        self._transfer = TransferConfig(
            multipart_threshold=c.part_size,
            multipart_chunksize=c.part_size,
            max_concurrency=c.max_concurrency,
            use_threads=True,
            preferred_transfer_client="classic",
        )
        return client

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # ------------------------------------------------------------------ writes
    def put_file(self, local_path: PathLike, key: str) -> None:
        full = self._key(key)
        path = os.fspath(local_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"put_file {self._name(full)}: no such file {path}")
        client = self.client
        try:
            self._retry(lambda: client.upload_file(path, self.config.bucket, full, Config=self._transfer),
                        f"upload {self._name(full)}")
        except Exception as e:  # noqa: BLE001
            raise self._error(e, "upload", full) from e

    def put_bytes(
        self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None
    ) -> str:
        if if_none_match and if_match is not None:
            raise ValueError("put_bytes: give if_none_match or if_match, not both")
        full = self._key(key)
        extra: dict[str, str] = {}
        if if_none_match:
            extra["IfNoneMatch"] = "*"
        if if_match is not None:
            extra["IfMatch"] = if_match
        try:
            response = self._retry(
                lambda: self.client.put_object(Bucket=self.config.bucket, Key=full, Body=bytes(data), **extra),
                f"put {self._name(full)}", resend_safe=not extra,  # a conditional write is not sent twice
            )
        except Exception as e:  # noqa: BLE001
            error = self._error(e, "put", full)
            if isinstance(error, NotFound) and if_match is not None:  # AWS answers 404 here
                error = PreconditionFailed(f"{self._name(full)}: does not exist (if_match)")
            raise error from e
        return str(response["ETag"])

    def delete(self, keys: Iterable[str]) -> None:
        fulls = [self._key(k) for k in keys]  # check every key before deleting any
        for start in range(0, len(fulls), DELETE_BATCH):
            batch = fulls[start : start + DELETE_BATCH]
            try:
                response = self._retry(lambda batch=batch: self.client.delete_objects(
                    Bucket=self.config.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                ), f"delete {self._name(batch[0])}")
            except Exception as e:  # noqa: BLE001
                raise self._error(e, "delete", batch[0]) from e
            errors = response.get("Errors") or []
            if errors:
                shown = ", ".join(f"{err.get('Key')}: {err.get('Code')}" for err in errors[:5])
                raise StorageError(f"delete in {self.uri}: {len(errors)} keys failed ({shown})")

    # ------------------------------------------------------------------ reads
    def get_file(self, key: str, local_path: PathLike) -> None:
        full = self._key(key)
        client = self.client
        with atomic_path(local_path, durable=False) as tmp:  # a copy that can be fetched again
            try:
                # objects above part_size come as parallel ranged GETs
                self._retry(lambda: client.download_file(self.config.bucket, full, str(tmp), Config=self._transfer),
                            f"download {self._name(full)}")
            except Exception as e:  # noqa: BLE001
                raise self._error(e, "download", full) from e

    def get_bytes(self, key: str) -> tuple[bytes, str]:
        from botocore.exceptions import IncompleteReadError, ReadTimeoutError, ResponseStreamingError

        full = self._key(key)
        for attempt in range(1, self.config.max_attempts + 1):
            try:
                response = self._retry(lambda: self.client.get_object(Bucket=self.config.bucket, Key=full),
                                       f"get {self._name(full)}")
                # botocore retries the request, not a body cut off midway: retry that here
                return response["Body"].read(), str(response["ETag"])
            except (IncompleteReadError, ReadTimeoutError, ResponseStreamingError) as e:
                if attempt == self.config.max_attempts:
                    raise self._error(e, "get", full) from e
            except Exception as e:  # noqa: BLE001
                raise self._error(e, "get", full) from e
        raise AssertionError("unreachable")

    def exists(self, key: str) -> bool:
        try:
            self._head(self._key(key))
        except NotFound:
            return False
        return True

    def size(self, key: str) -> int:
        return int(self._head(self._key(key))["ContentLength"])

    def list(self, prefix: str = "") -> Iterator[str]:
        check_prefix(prefix)
        base = f"{self.config.prefix}/" if self.config.prefix else ""
        args = {"Bucket": self.config.bucket, "Prefix": base + prefix, "MaxKeys": self.config.list_page_size}
        while True:  # page by page, each retried through an outage on its own
            try:
                page = self._retry(lambda args=args: self.client.list_objects_v2(**args),
                                   f"list {self._name(base + prefix)}")
            except Exception as e:  # noqa: BLE001
                raise self._error(e, "list", base + prefix) from e
            for item in page.get("Contents") or []:
                yield item["Key"][len(base) :]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            args = {**args, "ContinuationToken": token}

    # ------------------------------------------------------------------ helpers
    def _head(self, full: str) -> dict[str, Any]:
        try:
            return self._retry(lambda: self.client.head_object(Bucket=self.config.bucket, Key=full),
                               f"head {self._name(full)}")
        except Exception as e:  # noqa: BLE001
            raise self._error(e, "head", full) from e

    def _retry(self, call: Callable[[], T], what: str, *, resend_safe: bool = True) -> T:
        """``call()`` through an outage of the store: botocore's attempts, then ``retry_outage``."""
        return retry_outage(call, budget=self.config.outage_retry_s, what=what, resend_safe=resend_safe)

    def _key(self, key: str) -> str:
        return join(self.config.prefix, check_key(key))

    def _name(self, full: str | None) -> str:
        return f"s3://{self.config.bucket}/{full}" if full is not None else self.uri

    def _error(self, exc: BaseException, op: str, full: str | None) -> StorageError:
        """Our error for a boto3/botocore one. Secrets (credentials, URL userinfo) are scrubbed from
        its message and, in place, from ``exc`` and its chain, which stays attached as the cause."""
        error = self._describe(exc, op, full)
        redact.scrub_exception(exc, self._secrets())
        return error

    def _describe(self, exc: BaseException, op: str, full: str | None) -> StorageError:
        from botocore.exceptions import ClientError

        name = self._name(full)
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, ClientError):
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, ClientError):
            err = cause.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                return StorageError(self._scrub(f"{op} {name}: bucket {self.config.bucket} does not exist"))
            if code in NOT_FOUND_CODES or status == 404:
                return NotFound(f"{name}: no such key")
            if code in PRECONDITION_CODES or status == 412:
                return PreconditionFailed(f"{name}: precondition failed ({code or status})")
            message = err.get("Message") or ""
            if code == "AccessDenied":  # SeaweedFS also answers writes to a missing bucket so
                message += " (check the credentials, and that the bucket exists)"
            return StorageError(self._scrub(f"{op} {name}: {code} (HTTP {status}) {message}".rstrip()))
        where = f" at {self.config.endpoint_url}" if self.config.endpoint_url else ""
        return StorageError(self._scrub(f"{op} {name}{where}: {type(exc).__name__}: {exc}"))

    def _resolved(self) -> list[str]:
        """The credentials the client signs with now (from the config, environment or profile)."""
        if self._credentials is None:
            return []
        try:
            frozen = self._credentials.get_frozen_credentials()  # refreshed ones too
        except Exception:  # noqa: BLE001 - no credentials to scrub then
            return []
        return [v for v in (frozen.access_key, frozen.secret_key, frozen.token) if v]

    def _secrets(self) -> list[str]:
        c = self.config
        given = [v.get_secret_value() for v in (c.secret_access_key, c.session_token, c.access_key_id) if v]
        return given + self._resolved()

    def _scrub(self, text: str) -> str:
        return redact.scrub(text, self._secrets())
