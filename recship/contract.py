"""The artifact contract's plain records, importable without torch, the trainer or the quantizer: what export writes
and serving reads (issue 39 grows this into the contract's one home; the manifest types still live in
``recship.export.artifact``).

``Shard``: one block of one table as the manifest's ``sharding.shards`` records it.
"""

from dataclasses import dataclass
from typing import Any, Dict


@dataclass
class Shard:
    """One block of one table: rows [row_offset, +rows), columns [col_offset, +cols), on device index ``device``."""

    table: str
    index: int
    device: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int

    def to_dict(self) -> Dict[str, Any]:
        return dict(vars(self))


__all__ = ["Shard"]
