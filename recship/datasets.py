"""TorchRec's ``torchrec.datasets`` names that its examples import: the Criteo layout constants (``criteo``),
``Batch`` (``utils``) and ``RandomRecDataset`` (``random``); the import map sends every ``torchrec.datasets`` path
here. recship's own Criteo reader is ``recship.trainer.data.CriteoTSV`` (what ``recship train --data FILE`` reads);
TorchRec's preprocessed-Criteo pipelines are not here.
"""

from dataclasses import dataclass
from typing import Iterator, List, Optional

import torch
from torch.utils.data import IterableDataset

from recship.names import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE
from recship.sparse import KeyedJaggedTensor

# torchrec.datasets.criteo: a line is the label, 13 integer features, 26 categorical ones
INT_FEATURE_COUNT = CRITEO_NUM_DENSE
CAT_FEATURE_COUNT = CRITEO_NUM_SPARSE
DAYS = 24
DEFAULT_LABEL_NAME = "label"
DEFAULT_INT_NAMES: List[str] = [f"int_{i}" for i in range(INT_FEATURE_COUNT)]
DEFAULT_CAT_NAMES: List[str] = [f"cat_{i}" for i in range(CAT_FEATURE_COUNT)]
DEFAULT_COLUMN_NAMES: List[str] = [DEFAULT_LABEL_NAME, *DEFAULT_INT_NAMES, *DEFAULT_CAT_NAMES]


@dataclass
class Batch:
    """One training batch as TorchRec's examples pass it (``torchrec.datasets.utils.Batch``): dense features
    [B, num_dense], sparse features (a KeyedJaggedTensor of B examples), labels [B]."""

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(self.dense_features.to(device, non_blocking=non_blocking),
                     self.sparse_features.to(device, non_blocking=non_blocking), self.labels.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return Batch(self.dense_features.pin_memory(), self.sparse_features.pin_memory(), self.labels.pin_memory())


class RandomRecDataset(IterableDataset):
    """Random batches (``torchrec.datasets.random.RandomRecDataset``): ``ids_per_feature`` ids an example for each of
    ``keys``, uniform in [0, ``hash_size``) (or each key's of ``hash_sizes``), dense features uniform in [0, 1), labels
    0 or 1. ``num_generated_batches`` batches are drawn once (from ``manual_seed``, if given) and repeated; the
    iteration ends after ``num_batches`` batches, or never."""

    def __init__(self, keys: List[str], batch_size: int, hash_size: Optional[int] = 100, hash_sizes: Optional[List[int]] = None,
                 ids_per_feature: Optional[int] = 2, ids_per_features: Optional[List[int]] = None, num_dense: int = 50,
                 manual_seed: Optional[int] = None, num_generated_batches: int = 10, num_batches: Optional[int] = None,
                 is_weighted: bool = False) -> None:
        super().__init__()
        given_sizes = hash_sizes if hash_sizes is not None else [hash_size] * len(keys)
        given_counts = ids_per_features if ids_per_features is not None else [ids_per_feature] * len(keys)
        sizes = [s for s in given_sizes if s is not None and s >= 1]
        counts = [c for c in given_counts if c is not None and c >= 0]
        if not len(sizes) == len(counts) == len(given_sizes) == len(given_counts) == len(keys):
            raise ValueError(f"RandomRecDataset: {len(keys)} keys need as many hash sizes >= 1 and ids per feature >= 0, "
                             f"got {given_sizes} and {given_counts}")
        if batch_size < 1 or num_generated_batches < 1:
            raise ValueError(f"RandomRecDataset: batch_size and num_generated_batches must be >= 1, got {batch_size} and "
                             f"{num_generated_batches}")
        g = torch.Generator()
        if manual_seed is not None:
            g.manual_seed(manual_seed)
        else:
            g.seed()
        self.num_batches = num_batches
        self._batches = [self._draw(keys, batch_size, sizes, counts, num_dense, is_weighted, g) for _ in range(num_generated_batches)]

    @staticmethod
    def _draw(keys: List[str], batch_size: int, sizes: List[int], counts: List[int], num_dense: int, weighted: bool,
              g: torch.Generator) -> Batch:
        lengths = torch.tensor(counts, dtype=torch.int32).repeat_interleave(batch_size)
        values = torch.cat([torch.randint(0, size, (count * batch_size,), generator=g) for size, count in zip(sizes, counts)])
        weights = torch.rand(values.numel(), generator=g) if weighted else None
        sparse = KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths, weights=weights)
        return Batch(torch.rand(batch_size, num_dense, generator=g), sparse, torch.randint(0, 2, (batch_size,), generator=g).float())

    def __iter__(self) -> Iterator[Batch]:
        produced = 0
        while self.num_batches is None or produced < self.num_batches:
            yield self._batches[produced % len(self._batches)]
            produced += 1
