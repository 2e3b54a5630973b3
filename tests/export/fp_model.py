"""A ranker over a user's history weighted by position (TorchRec's FeatureProcessedEmbeddingBagCollection with a
PositionWeightedModuleCollection) beside a plain EmbeddingBagCollection: ``recship train --model
tests.export.fp_model:build`` trains it and ``recship export`` serves it (tests/export/test_fp_ebc_export.py).
Requests send ids only: the model weights its history ids itself."""

from typing import Optional

import torch
from torch import nn

from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.trainer.feature_processors import FeatureProcessedEmbeddingBagCollection, PositionWeightedModuleCollection

MAX_HISTORY = 8  # longest history a request may send (the position weights' length)


class PositionRanker(nn.Module):
    """[B, 1] logits of dense [B, 2], user and item ids (plain lookups) and a history of up to 8 item ids per example,
    pooled with one learnt weight per position."""

    num_dense = 2

    def __init__(self, dim: int = 8, device: Optional[str] = None) -> None:
        super().__init__()
        history = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="t_history", embedding_dim=dim, num_embeddings=60, feature_names=["history"])],
            is_weighted=True, device=device)
        self.fp = FeatureProcessedEmbeddingBagCollection(history, PositionWeightedModuleCollection({"history": MAX_HISTORY}, device=device))
        self.ebc = EmbeddingBagCollection([
            EmbeddingBagConfig(name="t_user", embedding_dim=dim, num_embeddings=50, feature_names=["user"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=dim, num_embeddings=40, feature_names=["item"]),
        ], device=device)
        self.over = nn.Sequential(nn.Linear(3 * dim + self.num_dense, 16, device=device), nn.ReLU(), nn.Linear(16, 1, device=device))

    def forward(self, dense: torch.Tensor, features) -> torch.Tensor:
        history = self.fp(features).values()
        plain = self.ebc(features).values()
        return self.over(torch.cat([dense, plain, history], dim=1))


def build(dim: int = 8, device: Optional[str] = None) -> PositionRanker:
    return PositionRanker(dim=dim, device=device)
