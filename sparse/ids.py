"""The id rule: an id looks up row ``id`` of its table, so it must lie in [0, rows).

Every check in recship (float and quantized modules, the sharded modules, the
server's validation) uses ``first_out_of_range`` and reports with
``out_of_range_message``; the C++ loader words its error the same way. Both are
TorchScript-compatible, so scripted modules raise the same text.
"""

from typing import Optional

import torch


def first_out_of_range(ids: torch.Tensor, rows: int) -> Optional[int]:
    """An id of ``ids`` outside [0, rows) (the smallest if one is negative, else the largest), or None."""
    if ids.numel() == 0:
        return None
    lo, hi = torch.aminmax(ids)
    if int(lo) < 0:
        return int(lo)
    if int(hi) >= rows:
        return int(hi)
    return None


def out_of_range_message(feature: str, id: int, rows: int) -> str:
    """The one wording of the id rule's error: ``feature 'f': id 7 is out of range [0, 5)``."""
    return "feature '" + feature + "': id " + str(id) + " is out of range [0, " + str(rows) + ")"
