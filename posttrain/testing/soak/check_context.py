"""What the soak checks share: the soak folder, the store's contents, the versions rebuilt from
them and the promotion histories, each read once."""

from __future__ import annotations

import os
from functools import cached_property

from posttrain.testing.soak.check_model import Soak
from posttrain.testing.soak.check_replay import read_histories
from posttrain.testing.soak.check_store import INDEX, RUN_KEY_RE, StoreReader, rebuild_all, s3_client, verify_snapshot


class Context:
    """What the checks share: the soak folder, the store's contents and the versions rebuilt from it."""

    def __init__(self, soak: Soak, *, live: bool = True, store_client=None):  # noqa: ANN001 - a boto3 client
        self.soak, self.live = soak, live
        self._client = store_client

    @cached_property
    def store(self) -> StoreReader:
        st = self.soak.store
        names = self.soak.meta.get("credentials_env") or {}
        unset = [names.get(k) or f"({k}: unnamed)" for k in ("access_key", "secret_key") if not os.environ.get(names.get(k) or "")]
        if self._client is None and unset:
            raise RuntimeError(f"the store's credentials: environment variable(s) {', '.join(unset)} (soak.json "
                               "credentials_env) not set; export them as the soak had them")
        client = self._client or s3_client(st, names)
        return StoreReader(client, st.get("bucket", ""), st.get("prefix") or "")

    @cached_property
    def snapshots(self) -> dict:
        """identity -> check_store.Snapshot, for every folder of the store that has an index."""
        return {ident: verify_snapshot(self.store, ident, files)
                for ident, files in sorted(self.store.folders().items()) if INDEX in files}

    @cached_property
    def rebuilt(self) -> tuple[dict, list[str]]:
        return rebuild_all(self.store, self.snapshots)

    @cached_property
    def ledgers(self) -> dict[str, dict[str, dict]]:
        """run -> identity -> its ledger entry (as stored JSON)."""
        out: dict[str, dict[str, dict]] = {}
        for key in sorted(self.store.sizes):
            m = RUN_KEY_RE.fullmatch(key)
            if m and m.group(2).startswith("ledger/") and key.endswith(".json"):
                try:
                    entry = self.store.json(key)
                except ValueError:
                    entry = {"unreadable": key}
                out.setdefault(m.group(1), {})[m.group(2)[len("ledger/"):-len(".json")]] = entry
        return out

    @cached_property
    def histories(self) -> dict:
        """deployment -> check_replay.Replay of its stored history."""
        return read_histories(self.store)
