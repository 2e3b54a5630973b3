"""A ranker whose user and item ids go through managed collisions (TorchRec's ManagedCollisionEmbeddingBagCollection
with sorted-ids modules): ``recship train --model tests.export.mc_model:build`` trains it (slots go to the most
frequent ids every 2 steps) and ``recship export`` serves it with the remapping inside the model
(tests/export/test_mc_export.py). Requests send raw ids."""

from typing import Optional

import torch
from torch import nn

from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.trainer.managed_collisions import (DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, ManagedCollisionCollection,
                                                ManagedCollisionEmbeddingBagCollection, MCHManagedCollisionModule)

ROWS = {"t_user": 40, "t_item": 32}


class CollisionRanker(nn.Module):
    """[B, 1] logits of dense [B, 2] and user / item ids remapped by managed collisions before their lookups."""

    num_dense = 2

    def __init__(self, dim: int = 8, device: Optional[str] = None) -> None:
        super().__init__()
        tables = [EmbeddingBagConfig(name="t_user", embedding_dim=dim, num_embeddings=ROWS["t_user"], feature_names=["user"]),
                  EmbeddingBagConfig(name="t_item", embedding_dim=dim, num_embeddings=ROWS["t_item"], feature_names=["item"])]
        cpu = torch.device("cpu")  # the remapping state is small: it lives on the CPU whatever device the tables use
        mcc = ManagedCollisionCollection({
            "t_user": MCHManagedCollisionModule(zch_size=ROWS["t_user"], device=cpu, eviction_policy=DistanceLFU_EvictionPolicy(),
                                                eviction_interval=2, input_hash_size=ROWS["t_user"], buckets=2),
            "t_item": MCHManagedCollisionModule(zch_size=ROWS["t_item"], device=cpu, eviction_policy=LFU_EvictionPolicy(),
                                                eviction_interval=2, input_hash_size=ROWS["t_item"], buckets=2),
        }, tables)
        self.mc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables, device=device), mcc)
        self.over = nn.Sequential(nn.Linear(2 * dim + self.num_dense, 16, device=device), nn.ReLU(), nn.Linear(16, 1, device=device))

    def forward(self, dense: torch.Tensor, features) -> torch.Tensor:
        pooled, _ = self.mc(features)
        return self.over(torch.cat([dense, pooled.values()], dim=1))


def build(dim: int = 8, device: Optional[str] = None) -> CollisionRanker:
    return CollisionRanker(dim=dim, device=device)
