"""References to blocks and paths in flow parameters: patterns the deployments' schemas enforce."""

from __future__ import annotations

from prefect.blocks.core import Block

# <block-type-slug>/<name>, a pydantic pattern: its (Rust) regex has no lookahead and needs none ("$" is the
# end of the text there); the schema gets the lookahead from ``whole_value``.
BLOCK_REF = r"^[0-9a-z][-0-9a-z]*/[0-9A-Za-z][-0-9A-Za-z_.]*$"
ABSOLUTE = {"pattern": "^/"}  # in the schema, so a deployment refuses a relative path when the run is created


def whole_value(schema: dict) -> None:
    """A field's JSON schema hook: every pattern that ends in "$" also refuses a final newline, as
    Prefect checks it (Python's re.search, whose "$" matches before one)."""
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str) and value.endswith("$"):
            schema[key] = value + r"(?!\n)"
        for inner in value if isinstance(value, list) else [value]:
            if isinstance(inner, dict):
                whole_value(inner)


def block_ref(value):
    """A block parameter as ``<slug>/<name>``: a name as given, or a picked block (the block, or
    Prefect's ``{"$ref": ...}`` to it, as a flow run's stored parameters hold it)."""
    if isinstance(value, dict) and "$ref" in value:
        ref = value["$ref"]
        if isinstance(ref, dict) and isinstance(ref.get("block_document_slug"), str):
            return ref["block_document_slug"]
        try:
            value = Block.load_from_ref(ref)
        except Exception as e:  # noqa: BLE001 - say which reference could not be resolved
            raise ValueError(f"cannot load the block picked ({ref}): {type(e).__name__}: {e}") from None
    if isinstance(value, Block):
        name = getattr(value, "_block_document_name", None)
        if not name or getattr(value, "_is_anonymous", False):
            raise ValueError("pick a saved block (one with a name), or give <block-type-slug>/<name>")
        return f"{value.get_block_type_slug()}/{name}"
    return value
