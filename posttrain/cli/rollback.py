"""``posttrain rollback``: make production serve an earlier snapshot again, and record it (docs/promotion.md).

``--to previous`` is the champion before the current one in the deployment's promotion history;
``--to IDENTITY`` is any snapshot in the store. Everything that can be checked is checked before
production is touched: the deployment name, the identity's form, the token, ``--api-url``'s form,
the store, the target (in the store; an earlier champion for ``previous``; not the champion
already), and that the hot-load API answers and accepts the token. Each failure is one line on
stderr naming the option, exit status 2, with nothing hot-loaded or recorded. ``--dry-run`` stops
after these checks and prints what would be hot-loaded and recorded. The rollback then holds the
deployment's lease, checks the champion again (another promotion or rollback holding it, or one
that changed the champion since the checks: one line, exit status 1, nothing changed), records
the rollback and hot-loads the target. A hot-load that fails is followed by a ``reverted`` record
and production is made to serve the champion again: one line saying so, exit status 1.
"""

from __future__ import annotations

import argparse
import logging
import re
import time
from pathlib import Path

from posttrain.cli.s3_args import add_s3_options, s3_options


def add_store_options(p: argparse.ArgumentParser) -> None:
    """--store, --prefix and the S3 options, as ``posttrain gc`` has them."""
    p.add_argument("--store", required=True, help="s3://bucket/prefix, file:///path or a folder: where the chain "
                   "and its promotion histories are")
    p.add_argument("--prefix", default="", help="prefix in the store where the chain is published (the history is "
                   "under <prefix>/.posttrain/promotions/<deployment>/)")
    add_s3_options(p)


def open_history_store(args: argparse.Namespace):  # noqa: ANN201 - a context manager over a Store under --prefix
    """The store under ``--prefix``; a folder store must exist (these commands create no store)."""
    from contextlib import contextmanager

    from posttrain.cli.gc import _check_folder
    from posttrain.storage import open_store
    from posttrain.storage.prefixed import under

    _check_folder(args.store)
    options = s3_options(args)

    @contextmanager
    def opened():  # noqa: ANN202
        with open_store(args.store, **options) as base:
            yield under(base, args.prefix)

    return opened()


def check_deployment_option(name: str) -> str:
    from posttrain.cli import UsageError
    from posttrain.promote.history import HistoryError, check_deployment

    try:
        return check_deployment(name)
    except HistoryError as e:
        raise UsageError(f"--deployment: {e}") from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rollback", help="make a production deployment serve an earlier snapshot again, and record it",
                       description="Hot-load --to (previous: the champion before the current one in the "
                       "deployment's promotion history; or a snapshot identity in the store) into the production "
                       "deployment, then record the rollback in its history (docs/promotion.md).")
    add_store_options(p)
    p.add_argument("--deployment", required=True, metavar="ID",
                   help="the production deployment: its history's name and the id the hot-load API is called with")
    p.add_argument("--api-url", required=True, metavar="URL",
                   help="base URL of the hot-load API (CoreWeave, or posttrain serve: http://127.0.0.1:PORT)")
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token-env", default="CW_API_TOKEN", metavar="VAR",
                       help="environment variable holding the API token (default CW_API_TOKEN)")
    token.add_argument("--token-file", type=Path, metavar="FILE", help="file whose first line is the API token")
    p.add_argument("--to", required=True, metavar="previous|IDENTITY",
                   help="previous (the champion before the current one) or a snapshot identity in the store")
    p.add_argument("--reason", metavar="TEXT", help="why, recorded in the history (default: what was rolled back)")
    p.add_argument("--dry-run", action="store_true",
                   help="check everything and print what would be hot-loaded and recorded; change nothing")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="seconds the hot-load may take until every replica serves the target (default 1800)")
    p.add_argument("--poll-interval", type=float, default=2.0, metavar="SECONDS",
                   help="seconds between polls of the hot-load and its replicas (default 2)")
    p.set_defaults(func=cmd_rollback)


def _token(args: argparse.Namespace):  # noqa: ANN202 - a SecretStr
    from posttrain.cli import UsageError
    from posttrain.serve.serve_config import read_token

    try:
        return read_token(file=args.token_file) if args.token_file else read_token(env=args.token_env)
    except ValueError as e:
        option = f"--token-file {args.token_file}" if args.token_file else f"--token-env {args.token_env}"
        raise UsageError(f"{option}: {e}") from None


def _config(args: argparse.Namespace, deployment: str):  # noqa: ANN202 - a HotLoadConfig
    from pydantic import ValidationError

    from posttrain.cli import UsageError
    from posttrain.errors import describe_validation_error
    from posttrain.inference.config import HotLoadConfig
    from posttrain.polling import MIN_POLL_S

    if not args.timeout > 0:  # NaN fails too
        raise UsageError(f"--timeout {args.timeout:g}: must be above 0 seconds")
    if not MIN_POLL_S <= args.poll_interval < float("inf"):
        raise UsageError(f"--poll-interval {args.poll_interval:g}: must be at least {MIN_POLL_S} seconds (and finite)")
    token = _token(args)
    try:
        return HotLoadConfig(api_url=args.api_url, deployment_id=deployment, token=token, timeout=args.timeout,
                             poll_interval=args.poll_interval)
    except ValidationError as e:
        raise UsageError(f"--api-url {args.api_url}: {describe_validation_error(e)}") from None


def _plan(store, deployment: str, to: str) -> tuple[str, str | None, str, str | None, int]:  # noqa: ANN001
    """(target, champion, kind, base, records so far); UsageError naming --to when it cannot be rolled back to."""
    from posttrain.cli import UsageError
    from posttrain.promote.history import History
    from posttrain.promote.promoter import PromotionError, describe_snapshot, rollback_target

    history = History(store, "", deployment)
    try:
        target = rollback_target(history, to)
        kind, base = describe_snapshot(store, target)
    except PromotionError as e:
        text = str(e)
        raise UsageError(text if text.startswith("--to") else f"--to {to}: {text}") from None
    champion = history.champion()
    if target == champion:
        raise UsageError(f"--to {to}: {target} is already the champion of {deployment} (its history's last "
                         "promotion or rollback); nothing to roll back")
    return target, champion, kind, base, len(history.records())


def _probe(config, option: str) -> list[str]:  # noqa: ANN001
    """What the deployment's replicas serve now, per the API; UsageError when the API cannot be used."""
    from posttrain.cli import UsageError
    from posttrain.inference.contract import HotLoadAPIError, HotLoadUnavailable
    from posttrain.inference.hotload import CoreWeaveHotLoader
    from posttrain.inference.protocol import STATE_COMPLETED

    quick = config.model_copy(update={"max_attempts": 2, "request_timeout": min(config.request_timeout, 10.0),
                                      "timeout": min(config.timeout, 30.0)})
    quiet = logging.getLogger("posttrain.inference")  # its retry warning would be a second line
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with CoreWeaveHotLoader(quick) as probe:
            ops = probe.list_operations()
            done = [o for o in ops if (o.get("status") or {}).get("state") == STATE_COMPLETED]
            replicas = probe.replicas(str(done[0]["spec"]["id"])) if done else []
    except HotLoadUnavailable as e:
        raise UsageError(f"--api-url {config.api_url}: the hot-load API cannot be reached ({_why(e)})") from None
    except HotLoadAPIError as e:
        if e.status in (401, 403):
            raise UsageError(f"{option}: the hot-load API at {config.api_url} refused the token "
                             f"(HTTP {e.status})") from None
        raise UsageError(f"--api-url {config.api_url}: {str(e).splitlines()[0]}") from None
    finally:
        quiet.setLevel(level)
    return sorted({r.current_snapshot_identity or "-" for r in replicas})


def _why(e: Exception) -> str:
    """The gist of a connection failure: 'Connection refused', 'Name or service not known', a timeout."""
    text = str(e)
    if e.status is not None:  # type: ignore[attr-defined] - HotLoadUnavailable: 429 or 5xx
        return f"HTTP {e.status}"  # type: ignore[attr-defined]
    found = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if found:
        return found.group(1).strip()
    kind = re.search(r": (ConnectionError|ConnectTimeout|ReadTimeout|Timeout)\b", text)
    return kind.group(1) if kind else text.splitlines()[0][:200]


def cmd_rollback(args: argparse.Namespace) -> int:
    import sys

    from posttrain import redact
    from posttrain.cli import UsageError
    from posttrain.chain.errors import FormatError
    from posttrain.chain.format import check_identity
    from posttrain.inference.contract import HotLoadError
    from posttrain.inference.hotload import CoreWeaveHotLoader
    from posttrain.promote.history import HistoryError
    from posttrain.promote.promoter import PREVIOUS, Deployment, OperationLost, PromotionError, SwitchFailed, rollback
    from posttrain.storage.lease import LeaseLost

    t0 = time.monotonic()
    handler = logging.StreamHandler(sys.stderr)  # the hot-load client's warnings (retries, a fallback): one line each
    handler.setFormatter(logging.Formatter("posttrain: warning: %(message)s"))
    handler.addFilter(redact.LogFilter())
    logging.getLogger("posttrain").addHandler(handler)
    deployment = check_deployment_option(args.deployment)
    if args.to != PREVIOUS:
        try:
            check_identity(args.to, "--to")
        except FormatError as e:
            raise UsageError(f"{e} (give previous or a snapshot identity)") from None
    if args.reason is not None and not " ".join(args.reason.split()):
        raise UsageError("--reason is empty")
    config = _config(args, deployment)
    token_option = f"--token-file {args.token_file}" if args.token_file else f"--token-env {args.token_env}"
    with open_history_store(args) as store:
        try:
            target, champion, kind, base, count = _plan(store, deployment, args.to)
        except HistoryError as e:
            raise UsageError(f"--deployment {deployment}: {e}") from None
        serving = _probe(config, token_option)
        what = f"{target} (a delta of {base})" if kind == "delta" else f"{target} (a full snapshot)"
        if args.dry_run:
            print(f"dry run: deployment {deployment} at {config.api_url} would hot-load {what} from {store.uri}")
            print(f"the API reports it serving now: {', '.join(serving) or 'nothing hot-loaded yet'}; "
                  f"its history's champion: {champion or 'none'}")
            reason = " ".join(args.reason.split()) if args.reason else "(the default: what was rolled back)"
            print(f"would record #{count + 1}: rollback of {deployment} to {target}, previous {champion or 'none'}, "
                  f"reason: {reason}")
            print("nothing was hot-loaded or recorded")
            return 0
        try:
            with CoreWeaveHotLoader(config) as loader:
                done = rollback(store=store, production=Deployment(deployment, loader), to=args.to, run=None,
                                reason=args.reason, seen_champion=champion)
        except PromotionError as e:  # the history changed since the checks above
            raise UsageError(str(e) if str(e).startswith("--to") else f"--to {args.to}: {e}") from None
        except (OperationLost, SwitchFailed, LeaseLost) as e:  # another operation won; the hot-load failed and was
            # reverted; or its lease was lost mid-switch (the next operation makes production serve the champion)
            print(redact.scrub(f"posttrain: error: rollback of {deployment} to {target}: {e}"), file=sys.stderr)
            return 1
        except HotLoadError as e:  # a retry's hot-load of the champion
            print(redact.scrub(f"posttrain: error: rollback of {deployment} to {target}: {str(e).splitlines()[0]}"),
                  file=sys.stderr)
            return 1
        except HistoryError as e:
            print(redact.scrub(f"posttrain: error: the rollback of {deployment} to {target} could not be recorded: "
                               f"{' '.join(str(e).split())}; {target} was not hot-loaded"), file=sys.stderr)
            return 1
    record = done.record
    print(f"{deployment} serves {record.identity} now (previous champion: {record.previous or 'none'}); "
          f"recorded as #{record.seq} in {store.uri}; {time.monotonic() - t0:.1f}s "
          f"(hot-load {done.served.seconds:.1f}s)")
    return 0
