"""The id rule: an id looks up row ``id`` of its table, so it must lie in [0, rows).

Every check in recship (float and quantized modules, the sharded modules, the
server's validation) uses ``first_out_of_range`` and reports with
``out_of_range_message``; the C++ loader words its error the same way. Both are
TorchScript-compatible, so scripted modules raise the same text.
"""

from typing import Optional

import torch


def check_id_dtype(ids: torch.Tensor, what: str) -> None:
    """ValueError unless ``ids`` is a 1-D integer tensor. A KeyedJaggedTensor takes values of any dtype (float
    sequence features, as TorchRec's), so each embedding lookup checks its ids here: a float id 2.7 must never become
    row 2."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(what + ": ids must be an integer tensor (int64 or int32) to look up embedding rows, got "
                         + str(ids.dtype))
    if ids.dim() != 1:
        raise ValueError(what + ": ids must be 1-D [N] to look up embedding rows, got " + str(ids.dim()) + " dimensions")


def first_out_of_range(ids: torch.Tensor, rows: int) -> Optional[int]:
    """An id of ``ids`` outside [0, rows) (the smallest if one is negative, else the largest), or None. ValueError for
    non-integer ids (``check_id_dtype``)."""
    check_id_dtype(ids, "first_out_of_range")
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
