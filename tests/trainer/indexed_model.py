"""A model written as TorchRec users write it outside the tutorials: the pooled embedding taken by feature name from
what the collection returns (``self.ebc(features)["user"]``) and arithmetic on it. In training the collection is
sharded and returns an awaitable, which must behave as its KeyedTensor (tests/trainer/test_lazy_awaitable.py)."""

from typing import Optional

import torch
from torch import nn

from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig


class IndexedModel(nn.Module):
    num_dense = 4

    def __init__(self, device: Optional[str] = None, wait_first: bool = False) -> None:
        super().__init__()
        self.wait_first = wait_first  # the reference: index the KeyedTensor itself (.to_dict() waits in training)
        self.ebc = EmbeddingBagCollection([
            EmbeddingBagConfig(name="t_user", embedding_dim=8, num_embeddings=100, feature_names=["user"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=8, num_embeddings=80, feature_names=["item"]),
        ], device=device)
        self.dense = nn.Linear(self.num_dense, 8, device=device)

    def forward(self, dense: torch.Tensor, features) -> torch.Tensor:
        pooled = self.ebc(features)
        if self.wait_first:
            by_feature = pooled.to_dict()
            user, item = by_feature["user"], by_feature["item"]
        else:
            user, item = pooled["user"], pooled["item"]
        return (user * item).sum(1) + (self.dense(dense) * (user - item)).sum(1)


def build(device: Optional[str] = None, wait_first: bool = False) -> IndexedModel:
    return IndexedModel(device=device, wait_first=wait_first)
