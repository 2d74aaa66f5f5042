"""LoRA checkpoints: the adapter and a reference to its base (``adapter``), and the streamed,
bit-exact merge of an adapter into its base (``merge``). No Prefect, no chain: the merged folder
is an ordinary model folder that the publisher encodes like any other checkpoint."""

from posttrain.lora.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    BASE_REF,
    Adapter,
    BaseRef,
    LoraError,
    base_fingerprint,
    is_adapter_dir,
    read_adapter,
    write_base_ref,
)

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "BASE_REF", "Adapter", "BaseRef", "LoraError", "base_fingerprint",
           "is_adapter_dir", "read_adapter", "write_base_ref"]
