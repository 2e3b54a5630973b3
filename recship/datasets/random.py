"""TorchRec's ``torchrec.datasets.random``: ``RandomRecDataset``, whose batches are TorchRec's, draw for draw, for
the same ``manual_seed``."""

from typing import Iterator, List, Optional

import torch
from torch.utils.data import IterableDataset

from recship.datasets.utils import Batch
from recship.sparse import KeyedJaggedTensor


class RandomRecDataset(IterableDataset):
    """Random batches (``torchrec.datasets.random.RandomRecDataset``), drawn as TorchRec draws them, so the same
    ``manual_seed`` gives TorchRec's batches: for each key, B lengths uniform in [min_ids, ids] (int32) then their ids
    uniform in [0, hash size); then dense features [B, num_dense] standard normal; then labels [B], 0 or 1.

    Args:
        keys: the sparse features.
        batch_size: B.
        hash_size / hash_sizes: ids' range, one for all keys or one per key (default 100).
        ids_per_feature / ids_per_features: the most ids an example has per key (default 2).
        min_ids_per_feature / min_ids_per_features: the fewest (default: ``ids_per_feature`` when given, so every
            example has exactly that many; else 0).
        num_dense: dense width.
        manual_seed: seeds a generator of its own; None draws from torch's global generator (``torch.manual_seed``).
        num_batches: batches per pass (None: endless).
        num_generated_batches: batches drawn up front and repeated in turn; a negative number draws a new batch every
            time.
        is_weighted: (recship) the KJT gets a weight per id, uniform in [0, 1), drawn after the labels.

    Labels are float32 (TorchRec's are int64 with the same values), as losses take them.
    """

    def __init__(self, keys: List[str], batch_size: int, hash_size: Optional[int] = None,
                 hash_sizes: Optional[List[int]] = None, ids_per_feature: Optional[int] = None,
                 ids_per_features: Optional[List[int]] = None, num_dense: int = 50, manual_seed: Optional[int] = None,
                 num_batches: Optional[int] = None, num_generated_batches: int = 10,
                 min_ids_per_feature: Optional[int] = None, min_ids_per_features: Optional[List[int]] = None,
                 is_weighted: bool = False) -> None:
        super().__init__()
        sizes = list(hash_sizes) if hash_sizes is not None else [hash_size if hash_size else 100] * len(keys)
        most = list(ids_per_features) if ids_per_features is not None else [ids_per_feature if ids_per_feature else 2] * len(keys)
        if min_ids_per_features is None:
            fewest = min_ids_per_feature if min_ids_per_feature is not None else ids_per_feature
            min_ids_per_features = [fewest if fewest else 0] * len(keys)
        least = list(min_ids_per_features)
        if not len(sizes) == len(most) == len(least) == len(keys):
            raise ValueError(f"RandomRecDataset: {len(keys)} keys need as many hash sizes, ids per feature and min ids "
                             f"per feature; got {sizes}, {most} and {least}")
        for key, size, lo, hi in zip(keys, sizes, least, most):
            if size < 1 or lo < 0 or hi < lo:
                raise ValueError(f"RandomRecDataset: key {key!r} needs hash size >= 1 and 0 <= min ids <= ids, got "
                                 f"hash size {size}, ids {lo}..{hi}")
        if batch_size < 1:
            raise ValueError(f"RandomRecDataset: batch_size must be >= 1, got {batch_size}")
        self.keys, self.batch_size, self.num_dense, self.is_weighted = list(keys), batch_size, num_dense, is_weighted
        self._sizes, self._most, self._least = sizes, most, least
        self._generator: Optional[torch.Generator] = None
        if manual_seed is not None:
            self._generator = torch.Generator()
            self._generator.manual_seed(manual_seed)
        self.num_batches = num_batches
        self.num_generated_batches = num_generated_batches
        self._batches = [self._draw() for _ in range(max(num_generated_batches, 0))]

    def _draw(self) -> Batch:
        g = self._generator
        lengths, values = [], []
        for size, lo, hi in zip(self._sizes, self._least, self._most):
            length = torch.randint(lo, hi + 1, (self.batch_size,), dtype=torch.int32, generator=g)
            lengths.append(length)
            values.append(torch.randint(0, size, (int(length.sum()),), generator=g))
        dense = torch.randn(self.batch_size, self.num_dense, generator=g)
        labels = torch.randint(0, 2, (self.batch_size,), generator=g).float()
        all_values = torch.cat(values)
        weights = torch.rand(all_values.numel(), generator=g) if self.is_weighted else None
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=self.keys, values=all_values, lengths=torch.cat(lengths),
                                                     weights=weights)
        return Batch(dense, sparse, labels)

    def __iter__(self) -> Iterator[Batch]:
        produced = 0
        while self.num_batches is None or produced < self.num_batches:
            yield self._batches[produced % len(self._batches)] if self._batches else self._draw()
            produced += 1

    def __len__(self) -> int:
        """``num_batches``, as TorchRec's; an endless dataset (num_batches None) has no length (TypeError)."""
        if self.num_batches is None:
            raise TypeError("RandomRecDataset: num_batches is None, so the dataset is endless and has no len()")
        return self.num_batches


__all__ = ["Batch", "KeyedJaggedTensor", "RandomRecDataset"]
