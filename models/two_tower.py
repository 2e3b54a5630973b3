"""A two-tower retrieval model: a user tower and an item tower whose dot product scores a pair."""

from typing import Dict, Optional

import torch
from torch import nn

from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, PoolingType


class TwoTower(nn.Module):
    """User tower: the user id and country pooled by an EmbeddingBagCollection, the user's
    history of item ids looked up by an EmbeddingCollection and mean-pooled here, and
    log1p of the dense counts. Item tower: item id and category. Outputs (all [B, ...]):
    ``score`` [B, 1] (the towers' dot product), ``user_embedding`` and ``item_embedding`` [B, dim].

    Features: user, country, history, item, category. Trained on click labels: binary
    cross-entropy of ``score`` (``loss``); evaluated on ``score`` (``eval_output``).
    """

    eval_output = "score"

    def __init__(self, num_users: int = 1000, num_items: int = 2000, num_countries: int = 50, num_categories: int = 100,
                 dim: int = 32, num_dense: int = 4, device: Optional[str] = None) -> None:
        super().__init__()
        self.num_dense = num_dense
        self.user_tables = EmbeddingBagCollection([
            EmbeddingBagConfig(name="user_ids", num_embeddings=num_users, embedding_dim=dim, feature_names=["user"]),
            EmbeddingBagConfig(name="country_ids", num_embeddings=num_countries, embedding_dim=dim // 2, feature_names=["country"]),
        ], device=device)
        self.history = EmbeddingCollection([
            EmbeddingConfig(name="history_items", num_embeddings=num_items, embedding_dim=dim, feature_names=["history"]),
        ], device=device)
        self.item_tables = EmbeddingBagCollection([
            EmbeddingBagConfig(name="item_ids", num_embeddings=num_items, embedding_dim=dim, feature_names=["item"]),
            EmbeddingBagConfig(name="category_ids", num_embeddings=num_categories, embedding_dim=dim // 2,
                               feature_names=["category"], pooling=PoolingType.MEAN),
        ], device=device)
        self.user_mlp = nn.Sequential(nn.Linear(dim + dim // 2 + dim + num_dense, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.item_mlp = nn.Sequential(nn.Linear(dim + dim // 2, dim), nn.ReLU(), nn.Linear(dim, dim))
        if device != "meta":
            with torch.no_grad():
                for p in self.parameters():
                    if p.dim() == 2 and p.shape[1] > 0:
                        nn.init.normal_(p, 0, 0.1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        user = self.user_tables(features).values()
        history = self.history(features)["history"]
        lengths = history.lengths()
        example = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        pooled = torch.zeros_like(user[:, : history.values().shape[1]]).index_add_(0, example, history.values())
        pooled = pooled / lengths.clamp(min=1).unsqueeze(1).to(pooled.dtype)
        user_embedding = self.user_mlp(torch.cat([user, pooled, torch.log1p(dense.clamp(min=0))], dim=1))
        item_embedding = self.item_mlp(self.item_tables(features).values())
        score = (user_embedding * item_embedding).sum(dim=1, keepdim=True)
        return {"score": score, "user_embedding": user_embedding, "item_embedding": item_embedding}

    def loss(self, outputs: Dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(outputs["score"].view(-1), labels)
