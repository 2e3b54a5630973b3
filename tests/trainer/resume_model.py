"""A tiny model and data functions that note how they are called (``CALLS``), for the tests of what ``--resume``
takes from the checkpoint (tests/trainer/test_resume_config.py). One rank trains in the test's own process, so the
notes are readable there."""

from typing import Iterator, List, Optional, Tuple

import torch
from torch import nn

from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig

CALLS: List[Tuple[str, int]] = []  # (data function, batch_size) of each call


class Tiny(nn.Module):
    num_dense = 2

    def __init__(self, rows: int = 20, dim: int = 4, hidden: int = 4, device: Optional[str] = None) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection([
            EmbeddingBagConfig(name="t_a", embedding_dim=dim, num_embeddings=rows, feature_names=["a"]),
            EmbeddingBagConfig(name="t_b", embedding_dim=dim, num_embeddings=rows, feature_names=["b"]),
        ], device=device)
        self.mlp = nn.Sequential(nn.Linear(2 * dim + 2, hidden, device=device), nn.ReLU(), nn.Linear(hidden, 1, device=device))

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.ebc(features).values(), dense], dim=1)).squeeze(1)


def build(rows: int = 20, dim: int = 4, hidden: int = 4, device: Optional[str] = None) -> Tiny:
    return Tiny(rows, dim, hidden, device)


def _batches(name: str, stream: int, batch_size: int, rank: int, world_size: int, n: int = 6):
    CALLS.append((name, batch_size))
    for i in range(rank, n, world_size):
        g = torch.Generator().manual_seed(stream * 1000 + i)
        ids = torch.randint(0, 20, (2 * batch_size,), generator=g)
        kjt = KeyedJaggedTensor(keys=["a", "b"], values=ids, lengths=torch.ones(2 * batch_size, dtype=torch.int32))
        dense = torch.rand(batch_size, 2, generator=g)
        yield dense, kjt, (torch.rand(batch_size, generator=g) < torch.sigmoid(4 * dense[:, 0] - 2)).float()


def data(batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator:
    return _batches("data", 1, batch_size, rank, world_size)


def other_data(batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator:
    return _batches("other_data", 2, batch_size, rank, world_size)


def eval_data(batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator:
    return _batches("eval_data", 3, batch_size, rank, world_size)


def other_eval_data(batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator:
    return _batches("other_eval_data", 4, batch_size, rank, world_size)
