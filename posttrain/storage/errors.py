"""Errors of the object stores. Messages name the key or URI at fault, never a secret."""

from __future__ import annotations


class StorageError(Exception):
    """Base class: an object store operation failed."""


class NotFound(StorageError):
    """The key does not exist."""


class PreconditionFailed(StorageError):
    """A conditional write lost: the key exists (if_none_match) or changed (if_match)."""


class InvalidKey(StorageError, ValueError):
    """A key or prefix breaks the naming rules."""


class InvalidURI(StorageError, ValueError):
    """A store URI or its options cannot be used."""
