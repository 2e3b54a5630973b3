"""Batch invariance: every forward runs on blocks of exactly ``rows`` examples, so an answer never depends on its batch.

A dense layer's result for one row depends on the shape of the batch it ran in: a GEMM library picks its
kernel, blocking and vectorised tails by the number of rows (on this machine's MKL a [7, 429] x [429, 512]
product gives other bits than the same 7 rows inside 8 or more), and inductor's kernels take other tail paths
for other sizes. A server that batches requests together would then answer the same request differently
depending on who else was in the batch. Run every forward on exactly ``rows`` rows instead (the batch cut into
blocks, the last padded with empty examples: no ids, zero dense) and each row meets the same kernels at the
same shape wherever it sits: the answer depends only on the request and the version (tested at 1, 2 and 4
intra-op threads; tests/export/test_batch_invariance.py).

The artifact records its block size (manifest ``row_block``; 0 or absent: whole batches, as artifacts exported
before it); the sample outputs are recorded through the same blocks, and every loader (``open_artifact``, the
C++ ``Model``, so both serving fronts and ``recship_predict``) runs them so. The C++ loader's
``Model::Impl::forward`` cuts blocks the same way.
"""

from typing import Any, Callable, Dict, List, Optional

import torch

DEFAULT_ROW_BLOCK = 64  # examples per forward of a new export (recship export --row-block); README "The same request, the same answer"

Forward = Callable[..., Dict[str, torch.Tensor]]


def run_in_blocks(model: Forward, rows: int, num_features: int, dense: torch.Tensor, lengths: torch.Tensor,
                  values: torch.Tensor, weights: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """``model(dense, lengths, values, weights)`` computed block by block: each call gets ``rows`` examples.

    dense [B, num_dense] float32, lengths [num_features * B] int32 (feature-major), values [N] int64 and
    weights [N] float32 or None (feature-major, as lengths): the model's flat inputs. Returns the model's
    outputs for the B examples (each [B, ...]). ``rows`` <= 0 runs the batch whole. Inputs whose shapes do not
    agree go to the model unchanged, so its own check names what is wrong.
    """
    batch = dense.shape[0] if dense.dim() == 2 else -1
    if (rows <= 0 or batch < 1 or lengths.dim() != 1 or lengths.numel() != num_features * batch
            or values.dim() != 1 or int(lengths.sum()) != values.numel()):
        return model(dense, lengths, values, weights)
    blocks = -(-batch // rows)
    pad = blocks * rows - batch
    per_row = lengths.view(num_features, batch)
    if pad:
        per_row = torch.cat([per_row, per_row.new_zeros(num_features, pad)], dim=1)
        dense = torch.cat([dense, dense.new_zeros(pad, dense.shape[1])])
    per_row = per_row.view(num_features, blocks, rows)
    if blocks == 1:
        values_of = [values]
        weights_of: List[Optional[torch.Tensor]] = [weights]
    else:
        # ids are feature-major (feature 0 of every example, then feature 1...); a block needs its own examples'
        # ids, still feature-major: a stable sort by block keeps each feature's ids in order within the block
        counts = per_row.sum(dim=2)  # [F, blocks] ids of each feature in each block
        block_of_id = torch.repeat_interleave(torch.arange(blocks, device=lengths.device).repeat(num_features),
                                              counts.reshape(-1).long())
        order = torch.sort(block_of_id, stable=True).indices
        sizes = counts.sum(dim=0).tolist()
        values_of = list(values[order].split(sizes))
        weights_of = list(weights[order].split(sizes)) if weights is not None else [None] * blocks
    parts: List[Dict[str, torch.Tensor]] = []
    for b in range(blocks):
        w = weights_of[b]
        parts.append(model(dense[b * rows:(b + 1) * rows], per_row[:, b, :].reshape(-1).contiguous(),
                           values_of[b].contiguous(), None if w is None else w.contiguous()))
    if blocks == 1:
        return {name: t[:batch] for name, t in parts[0].items()}
    return {name: torch.cat([p[name] for p in parts])[:batch] for name in parts[0]}


class RowBlocks:
    """A loaded model (TorchScript module or AotiModel) called as before, but block by block (``run_in_blocks``).

    Everything else (``format``, the module's methods and attributes) is the wrapped model's.
    """

    def __init__(self, model: Any, rows: int, num_features: int) -> None:
        self.model = model
        self.rows = rows
        self._num_features = num_features

    def __call__(self, dense: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor,
                 weights: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        return run_in_blocks(self.model, self.rows, self._num_features, dense, lengths, values, weights)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["model"], name)


def unwrapped(model: Any) -> Any:
    """The loaded model itself (TorchScript module or AotiModel) of what ``open_artifact`` returned."""
    return model.model if isinstance(model, RowBlocks) else model
