from tests.storage.conftest import moto_endpoint, raw_client, seaweedfs_bucket, seaweedfs_endpoint  # noqa: F401
