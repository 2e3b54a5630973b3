"""An --eval-data entry point for the tests: labelled batches of the two-tower example's features."""

import torch

from recship.sparse import KeyedJaggedTensor

ROWS = {"user": 300, "country": 20, "history": 500, "item": 500, "category": 30}


def two_tower_batches(batch_size: int):
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        lengths = torch.randint(1, 4, (len(ROWS) * batch_size,), generator=g)
        limits = torch.tensor(list(ROWS.values())).repeat_interleave(batch_size).repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=g) * limits).long()
        kjt = KeyedJaggedTensor(keys=list(ROWS), values=values, lengths=lengths.to(torch.int32))
        yield torch.rand(batch_size, 4, generator=g) * 10, kjt, (torch.rand(batch_size, generator=g) < 0.3).float()
