"""The S3 connection options that every command reading or writing a store takes, and the
``open_store`` keyword arguments they give (``posttrain.storage.open_store``)."""

from __future__ import annotations

import argparse


def add_s3_options(p: argparse.ArgumentParser, *, part_size: bool = False) -> None:
    """--endpoint-url, --region, --profile, --outage-retry (and --part-size, for commands that upload)."""
    p.add_argument("--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 or AWS)")
    p.add_argument("--region", help="S3 region")
    p.add_argument("--profile", help="AWS profile for credentials")
    if part_size:
        p.add_argument("--part-size", type=int, help="multipart part size in bytes (CoreWeave advises >= 50 MB)")
    p.add_argument("--outage-retry", type=float, metavar="SECONDS",
                   help="keep retrying this long while the S3 store is unreachable (default 120; 0: fail at once)")


def s3_options(args: argparse.Namespace) -> dict:
    """The options given on the command line, as ``open_store`` keywords (unset ones left out)."""
    given = {"endpoint_url": args.endpoint_url, "region": args.region, "profile": args.profile,
             "part_size": getattr(args, "part_size", None), "outage_retry_s": args.outage_retry}
    return {k: v for k, v in given.items() if v is not None}
