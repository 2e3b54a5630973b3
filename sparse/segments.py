"""Reordering runs of rows (segments) of a jagged tensor, in plain PyTorch.

A jagged layout stores its rows in runs: a KeyedJaggedTensor's lengths in one run per key (``stride_per_key()``
entries each) and its values in one run per key (``length_per_key()`` entries each); after an all-to-all the runs
are per (rank, key). Permuting keys, or regrouping what ranks sent, reorders such runs, possibly repeating or
dropping some. ``permute_segments`` does that with one gather (what fbgemm's ``permute_1D_sparse_data`` computes),
so it runs on any device, under TorchScript, and for values of any dtype and trailing shape.
"""

from typing import Optional, Tuple

import torch


def permute_segments(
    t: torch.Tensor, segment_lengths: torch.Tensor, order: torch.Tensor
) -> torch.Tensor:
    """``t`` ([N, ...], cut into consecutive segments of ``segment_lengths`` [S] rows, sum N) with its segments
    taken in ``order`` ([S'] indices in [0, S); a segment may repeat or be left out): segment j of the result is
    segment ``order[j]`` of ``t``."""
    seg = segment_lengths.to(device=t.device, dtype=torch.int64)
    order64 = order.to(device=t.device, dtype=torch.int64)
    starts = torch.cumsum(seg, dim=0) - seg
    picked = seg.index_select(0, order64)
    out_starts = torch.cumsum(picked, dim=0) - picked
    # row r of the result, inside picked segment j, reads row r - out_starts[j] + starts[order[j]] of t
    shift = torch.repeat_interleave(starts.index_select(0, order64) - out_starts, picked)
    rows = torch.arange(shift.shape[0], device=t.device, dtype=torch.int64) + shift
    return t.index_select(0, rows)


def permute_jagged(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: Optional[torch.Tensor],
    rows_per_segment: torch.Tensor,
    order: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(lengths, values, weights) with their segments in ``order``: segment s holds ``rows_per_segment[s]``
    entries of ``lengths`` and the values (and weights) those lengths cover."""
    rows = rows_per_segment.to(device=lengths.device, dtype=torch.int64)
    lengths64 = lengths.to(torch.int64)
    cum = torch.cat([lengths64.new_zeros(1), torch.cumsum(lengths64, dim=0)])
    ends = torch.cumsum(rows, dim=0)
    ids_per_segment = cum.index_select(0, ends) - cum.index_select(0, ends - rows)
    new_values = permute_segments(values, ids_per_segment, order)
    new_weights = None if weights is None else permute_segments(weights, ids_per_segment, order)
    return permute_segments(lengths, rows, order), new_values, new_weights


def empty_index_or_same(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """An empty lengths/offsets tensor of any shape or dtype (``torch.tensor([])`` is float32; ``[[], []]`` is
    [2, 0]) carries no data: it becomes [0] int32, as ``KeyedJaggedTensor.empty()``'s; anything else is returned
    as it is (and validated by the caller)."""
    if t is None or t.numel() != 0:
        return t
    if t.dim() == 1 and not t.is_floating_point():
        return t
    return torch.empty(0, dtype=torch.int32 if t.is_floating_point() else t.dtype, device=t.device)
