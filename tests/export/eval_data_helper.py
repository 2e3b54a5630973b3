"""A data function for the tests: labelled batches of the two-tower example's features."""

import torch

from recship.sparse import KeyedJaggedTensor

ROWS = {"user": 300, "country": 20, "history": 500, "item": 500, "category": 30}


def two_tower_batches(batch_size: int, rank: int = 0, world_size: int = 1, count: int = 3):
    """A data function (as ``recship train --data`` and ``recship export --eval-data`` take): ``count`` labelled batches."""
    g = torch.Generator().manual_seed(11 + rank)
    for _ in range(count):
        lengths = torch.randint(1, 4, (len(ROWS) * batch_size,), generator=g)
        limits = torch.tensor(list(ROWS.values())).repeat_interleave(batch_size).repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=g) * limits).long()
        kjt = KeyedJaggedTensor(keys=list(ROWS), values=values, lengths=lengths.to(torch.int32))
        yield torch.rand(batch_size, 4, generator=g) * 10, kjt, (torch.rand(batch_size, generator=g) < 0.3).float()


def wrong_features(batch_size: int, rank: int = 0, world_size: int = 1):
    """Batches of other features than the model's."""
    kjt = KeyedJaggedTensor(keys=["other"], values=torch.zeros(batch_size, dtype=torch.int64), lengths=torch.ones(batch_size, dtype=torch.int32))
    yield torch.zeros(batch_size, 4), kjt, torch.zeros(batch_size)
