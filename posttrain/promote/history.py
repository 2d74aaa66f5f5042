"""The promotion history of a production deployment: who serves what, since when and why.

One JSON record per event, next to the chain in the store (docs/promotion.md, "The history"):

    <prefix>/.posttrain/promotions/<deployment>/<seq, 8 digits>.json

Records are never rewritten: each is written create-only (``if_none_match``) at the next
sequence number. Two writers racing for a number: one wins, the other reads what won and tries
the next one. A record's ``previous`` must be the champion the records before it leave (checked
again at every number tried), so a promotion decided against a champion that another writer has
replaced meanwhile raises ``HistoryConflict`` instead of landing.

The champion is the identity of the last promotion or rollback. Champions form a stack: a
promotion pushes its identity; a rollback to an identity on the stack pops back to it (to one
that is not, pushes it). A record is written before production is switched; when the switch
then fails, a ``reverted`` record names it (``reverts``: its number): the reverted record
counts for nothing, so the champion is again the one before it. ``previous_champion`` is the entry under the top, so rolling back to
the previous champion again and again walks back through earlier promotions and never returns
to the one just rolled back from.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from posttrain.chain.errors import FormatError
from posttrain.chain.format import check_identity
from posttrain.errors import describe_validation_error
from posttrain.promote.decision import Decision
from posttrain.storage import NotFound, PreconditionFailed, Store
from posttrain.storage.keys import check_prefix, join

FORMAT = "posttrain.promotion/1"
PROMOTIONS = ".posttrain/promotions"
DEPLOYMENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
RECORD_NAME_RE = re.compile(r"(\d{8})\.json")
# Each lost race means another writer's record landed, so this many writers at once still get through.
MAX_ATTEMPTS = 64

Kind = Literal["promotion", "refusal", "rollback", "reverted"]


class HistoryError(Exception):
    """A promotion history cannot be read, or a record cannot be written to it."""


class HistoryConflict(HistoryError):
    """The champion changed since the record was prepared: decide again against the new one."""


def check_deployment(name: str) -> str:
    """A deployment name is one path segment: 1-128 of letters, digits, ``_``, ``.``, ``-``, starting alphanumeric."""
    if not isinstance(name, str) or not DEPLOYMENT_RE.fullmatch(name):
        raise HistoryError(f"deployment name {name!r} must be 1-128 letters, digits, '_', '.' or '-', starting "
                           "with a letter or digit (one path segment of the store)")
    return name


class Record(BaseModel):
    """One event in a deployment's promotion history."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["posttrain.promotion/1"] = Field(FORMAT, description="Format of the record.")
    seq: int | None = Field(None, ge=1, description="Position in the history; History.append sets it.")
    kind: Kind = Field(description="promotion: identity now serves; refusal: the gate kept the champion; "
                       "rollback: identity serves again; reverted: the switch to identity that record `reverts` "
                       "announced failed, and that record counts for nothing.")
    deployment: str = Field(description="The production deployment's name.")
    identity: str = Field(description="The snapshot the record is about: promoted, refused or rolled back to.")
    previous: str | None = Field(None, description="The champion before this record; None when there was none.")
    run: str | None = Field(None, description="Run that wrote it (None for an operator's rollback).")
    at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc), description="When, in UTC.")
    decision: Decision | None = Field(None, description="The gate's decision (promotion and refusal).")
    reason: str = Field(description="One line: why.")
    reverts: int | None = Field(None, ge=1, description="reverted: the number of the record whose switch failed.")

    @field_validator("deployment")
    @classmethod
    def _deployment(cls, v: str) -> str:
        try:
            return check_deployment(v)
        except HistoryError as e:
            raise ValueError(str(e)) from None

    @field_validator("identity", "previous")
    @classmethod
    def _identity(cls, v: str | None) -> str | None:
        try:
            return None if v is None else check_identity(v)
        except FormatError as e:
            raise ValueError(str(e)) from None

    @field_validator("at")
    @classmethod
    def _utc(cls, v: datetime) -> datetime:
        if v.tzinfo is None:
            raise ValueError("must carry a time zone (UTC)")
        return v.astimezone(timezone.utc)

    @field_validator("reason")
    @classmethod
    def _one_line(cls, v: str) -> str:
        if not v.strip() or "\n" in v:
            raise ValueError("must be one non-empty line")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Record:
        d = self.decision
        if (self.kind == "reverted") != (self.reverts is not None):
            raise ValueError("reverts: a reverted record names the record it reverts, and only it does")
        if self.kind == "reverted":
            if d is not None:
                raise ValueError("a reverted record carries no gate decision")
            return self
        if self.kind == "rollback":
            if d is not None:
                raise ValueError("a rollback carries no gate decision")
        elif d is None:
            raise ValueError(f"a {self.kind} needs the gate's decision")
        elif d.accepted != (self.kind == "promotion"):
            wanted = "accepted" if self.kind == "promotion" else "refused"
            got = "accepted" if d.accepted else "refused"
            raise ValueError(f"a {self.kind} needs a decision that {wanted} the candidate; this one {got} it")
        elif d.candidate not in (None, self.identity) or (d.champion is not None and d.champion != self.previous):
            raise ValueError(f"the decision compared {d.candidate} with {d.champion}, not {self.identity} with "
                             f"{self.previous}")
        if self.kind != "refusal" and self.identity == self.previous:
            raise ValueError(f"{self.identity} is already the champion")
        return self


class History:
    """The promotion history of ``deployment`` in ``store`` under ``prefix`` (the chain's key prefix)."""

    def __init__(self, store: Store, prefix: str, deployment: str):
        self.store = store
        self.deployment = check_deployment(deployment)
        self.folder = join(check_prefix(prefix).rstrip("/"), f"{PROMOTIONS}/{deployment}") + "/"
        # A record is written once (put if-none-match) and never changed, so each is read once per History:
        # every records() lists the folder again (what was added or removed meanwhile) but reads only
        # the records it has not read yet. A promotion or rollback asks for the records several times.
        self._read_records: dict[str, Record] = {}

    def key(self, seq: int) -> str:
        return f"{self.folder}{seq:08d}.json"

    def append(self, record: Record) -> Record:
        """Write ``record`` at the next sequence number; return it with its number."""
        if record.deployment != self.deployment:
            raise HistoryError(f"a record of deployment {record.deployment} cannot join the history of "
                               f"{self.deployment}")
        records = self.records()
        for _ in range(MAX_ATTEMPTS):
            champion = champions(records)
            current = champion[-1] if champion else None
            if record.previous != current:
                raise HistoryConflict(f"deployment {self.deployment} serves {current or 'no champion'} according to "
                                      f"its history, not {record.previous or 'no champion'} (recorded meanwhile, or "
                                      "the record's previous is wrong): decide again against the current champion")
            seq = records[-1].seq + 1 if records else 1
            stored = record.model_copy(update={"seq": seq})
            body = stored.model_dump_json(indent=2).encode()
            try:
                self.store.put_bytes(self.key(seq), body, if_none_match=True)
                self._read_records[self.key(seq)] = stored
                return stored
            except PreconditionFailed:
                try:  # our own write whose response was lost, retried by the client?
                    if self.store.get_bytes(self.key(seq))[0] == body:
                        return stored
                except NotFound:
                    pass
                records = self.records()  # another writer took the number: see what it wrote
        raise HistoryError(f"{self.store.uri}: {self.folder}: lost the race for a sequence number "
                           f"{MAX_ATTEMPTS} times")

    def records(self) -> list[Record]:
        """Every record, oldest first."""
        out = []
        for key in self.store.list(self.folder):
            m = RECORD_NAME_RE.fullmatch(key[len(self.folder):])
            if m:  # anything else in the folder is not ours to read
                if key not in self._read_records:
                    self._read_records[key] = self._read(key, int(m.group(1)))
                out.append(self._read_records[key])
        return sorted(out, key=lambda r: r.seq)

    def champion(self) -> str | None:
        """The identity production serves according to the history: the last promotion or rollback."""
        stack = champions(self.records())
        return stack[-1] if stack else None

    def previous_champion(self) -> str | None:
        """The champion before the current one (what ``rollback --to previous`` restores), or None."""
        stack = champions(self.records())
        return stack[-2] if len(stack) > 1 else None

    def identities(self) -> set[str]:
        """Every snapshot the history names: garbage collection keeps them."""
        return {i for r in self.records() for i in (r.identity, r.previous) if i is not None}

    def _read(self, key: str, seq: int) -> Record:
        try:
            data, _ = self.store.get_bytes(key)
        except NotFound:
            raise HistoryError(f"{self.store.uri}: {key} was listed but is gone (was the history edited?)") from None
        try:
            record = Record.model_validate_json(data)
        except ValidationError as e:
            raise HistoryError(f"{self.store.uri}: {key} is not a {FORMAT} record: "
                               f"{describe_validation_error(e)}") from None
        if record.seq != seq or record.deployment != self.deployment:
            raise HistoryError(f"{self.store.uri}: {key} holds record {record.seq} of deployment "
                               f"{record.deployment}, not record {seq} of {self.deployment}")
        return record


def effective(records: list[Record]) -> list[Record]:
    """The records that count: without the reverted ones and the ``reverted`` records themselves."""
    void = {r.reverts for r in records if r.kind == "reverted"}
    return [r for r in records if r.kind != "reverted" and r.seq not in void]


def champions(records: list[Record]) -> list[str]:
    """The champion stack the records leave, oldest at the bottom (see the module docstring)."""
    stack: list[str] = []
    for r in effective(records):
        if r.kind == "promotion":
            stack.append(r.identity)
        elif r.kind == "rollback":
            if r.identity in stack:
                del stack[_last(stack, r.identity) + 1:]  # undo the promotions after it
            else:
                stack.append(r.identity)
    return stack


def _last(stack: list[str], identity: str) -> int:
    return len(stack) - 1 - stack[::-1].index(identity)
