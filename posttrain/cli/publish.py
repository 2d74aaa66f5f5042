"""``posttrain publish``: publish checkpoints as a snapshot chain in an object store."""

from __future__ import annotations

import argparse
from pathlib import Path

from posttrain.chain.format import MAX_CHAIN_DELTAS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("publish", help="publish checkpoints, in step order, as a chain in an object store")
    p.add_argument("checkpoints", nargs="+", type=Path, help="checkpoint folders (ordered by step)")
    p.add_argument("--store", required=True, help="s3://bucket/prefix (the deployment's hot-load bucket and "
                   "prefix) or a folder")
    p.add_argument("--run", required=True, help="run name; part of every identity")
    p.add_argument("--work-dir", type=Path, required=True, help="local scratch: spool queue, base, staging")
    p.add_argument("--flavor", choices=["coreweave", "slime"], default="coreweave")
    p.add_argument("--max-deltas", type=int, default=MAX_CHAIN_DELTAS,
                   help=f"deltas after a full snapshot before the next full one (at most {MAX_CHAIN_DELTAS})")
    p.add_argument("--delta-budget", type=float, default=1.0)
    p.add_argument("--sync", action="store_true", help="publish each checkpoint before taking the next")
    p.add_argument("--endpoint-url", help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 or AWS)")
    p.add_argument("--region", help="S3 region")
    p.add_argument("--profile", help="AWS profile for credentials")
    p.add_argument("--part-size", type=int, help="multipart part size in bytes (CoreWeave advises >= 50 MB)")
    p.set_defaults(func=cmd_publish)


def cmd_publish(args: argparse.Namespace) -> int:
    from posttrain.chain.ops import checkpoint_step
    from posttrain.chain.policy import ChainPolicy
    from posttrain.cli.chain import human_bytes
    from posttrain.publish import PublishConfig, Publisher
    from posttrain.storage import open_store

    options = {k: v for k, v in (("endpoint_url", args.endpoint_url), ("region", args.region),
                                 ("profile", args.profile), ("part_size", args.part_size)) if v is not None}
    store = open_store(args.store, **options)
    config = PublishConfig(run=args.run, work_dir=args.work_dir.resolve(), flavor=args.flavor,
                           policy=ChainPolicy(max_deltas=args.max_deltas, delta_budget=args.delta_budget),
                           async_publish=not args.sync)

    def report(p) -> None:
        print(f"published {p.kind} {p.identity} (step {p.step}): {human_bytes(p.stored_bytes)}, "
              f"{100 * p.stored_bytes / max(p.raw_bytes, 1):.2f}% of full, uploaded {human_bytes(p.uploaded_bytes)}",
              flush=True)

    publisher = Publisher(store, config, on_published=report)
    try:
        publisher.resume()  # whatever a previous run left spooled
        for ckpt in sorted(args.checkpoints, key=checkpoint_step):
            publisher.submit(ckpt)
        publisher.drain()
    finally:
        publisher.close()
        store.close()
    return 0
