"""Errors of the chain codec. Every message names the file, tensor or snapshot at fault."""

from __future__ import annotations


class ChainError(Exception):
    """Base class: bad input or a broken chain. Nothing was written when it is raised."""


class FormatError(ChainError):
    """A safetensors file, an index or a snapshot does not follow the format."""


class MissingBase(FormatError):
    """A delta's base is not in the chain folder: ``snapshot`` names the delta, ``base`` its base."""

    def __init__(self, message: str, snapshot: str, base: str) -> None:
        super().__init__(message)
        self.snapshot, self.base = snapshot, base


class LayoutMismatch(ChainError):
    """A delta was asked for across a change of tensor names, shapes or dtypes."""


class ChecksumMismatch(ChainError):
    """Reconstructed bytes do not match the checksum their snapshot recorded."""


class WrongBase(ChainError):
    """A delta was applied to a version other than its base."""


class OutputExists(ChainError):
    """The output folder already exists; nothing is overwritten."""
