"""Publishing snapshot chains to object storage: a crash-safe publisher, its ledger and spool."""

from posttrain.publish.publisher import PublishConfig, PublishedSnapshot, Publisher, PublishError

__all__ = ["PublishConfig", "PublishError", "PublishedSnapshot", "Publisher"]
