"""A two-head model and data functions with labels [B, 2], for tests/trainer/test_multi_task.py; ``LOSS_LABELS``
notes the shape of the labels each ``loss`` call gets (one rank trains in the test's process)."""

from typing import Dict, Iterator, List, Optional

import torch
from torch import nn

from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig

LOSS_LABELS: List[List[int]] = []


class TwoHeads(nn.Module):
    """Outputs ``a`` and ``b``, [B, 1] logits; ``loss`` is the sum of both heads' binary cross-entropy on labels [B, 2]."""

    num_dense = 2
    eval_output = "b"
    eval_outputs = {"a": 0, "b": 1}

    def __init__(self, device: Optional[str] = None) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=20, feature_names=["f"])],
                                          device=device)
        self.a = nn.Linear(6, 1, device=device)
        self.b = nn.Linear(6, 1, device=device)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        x = torch.cat([self.ebc(features).values(), dense], dim=1)
        return {"a": self.a(x), "b": self.b(x)}

    def loss(self, outputs: Dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        LOSS_LABELS.append(list(labels.shape))
        bce = nn.functional.binary_cross_entropy_with_logits
        return bce(outputs["a"].view(-1), labels[:, 0]) + bce(outputs["b"].view(-1), labels[:, 1])


class OneTaskLoss(TwoHeads):
    """Its loss takes labels [B] (one task): data with labels [B, 2] cannot train it."""

    def loss(self, outputs: Dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(outputs["a"].view(-1), labels)


class NoTasks(TwoHeads):
    """Names no task outputs."""

    eval_outputs = None  # type: ignore[assignment]


class NoLoss(nn.Module):
    """One logit, no loss of its own (binary cross-entropy on labels [B])."""

    num_dense = 2

    def __init__(self, device: Optional[str] = None) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=20, feature_names=["f"])],
                                          device=device)
        self.out = nn.Linear(6, 1, device=device)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.out(torch.cat([self.ebc(features).values(), dense], dim=1))


def build(kind: str = "TwoHeads", device: Optional[str] = None) -> nn.Module:
    return {"TwoHeads": TwoHeads, "OneTaskLoss": OneTaskLoss, "NoTasks": NoTasks, "NoLoss": NoLoss}[kind](device=device)


def _batches(stream: int, batch_size: int, rank: int, world_size: int, columns: int, n: int = 8) -> Iterator:
    for i in range(rank, n, world_size):
        g = torch.Generator().manual_seed(stream * 1000 + i)
        ids = torch.randint(0, 20, (batch_size,), generator=g)
        kjt = KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.ones(batch_size, dtype=torch.int32))
        dense = torch.rand(batch_size, 2, generator=g)
        a = torch.rand(batch_size, generator=g) < torch.sigmoid(4 * dense[:, 0] - 2)
        b = a & (torch.rand(batch_size, generator=g) < torch.sigmoid(4 * dense[:, 1] - 2))
        labels = torch.stack([a, b], dim=1).float()
        yield dense, kjt, labels if columns == 2 else labels[:, 0]


def data(batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator:
    """Labels [B, 2]: a, and a-and-b."""
    return _batches(1, batch_size, rank, world_size, 2)


def eval_data(batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator:
    return _batches(2, batch_size, rank, world_size, 2)


def one_column(batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator:
    """Labels [B]."""
    return _batches(1, batch_size, rank, world_size, 1)
