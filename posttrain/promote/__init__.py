"""Eval-gated promotion: the gate's decision rule (``decision``) and the promotion history
(``history``) that says which snapshot production serves and why. Plain Python; the Prefect
flows and the ``posttrain rollback`` command build on them (docs/promotion.md)."""

from __future__ import annotations

from posttrain.promote.decision import Decision, GateConfig, GateError, decide, first_promotion
from posttrain.promote.history import History, HistoryConflict, HistoryError, Record

__all__ = ["Decision", "GateConfig", "GateError", "History", "HistoryConflict", "HistoryError", "Record", "decide",
           "first_promotion"]
