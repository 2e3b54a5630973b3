"""A multi-task ranker over weighted (id-score) features with two heads."""

from typing import Dict, Optional

import torch
from torch import nn

from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType


class MultiTaskRanker(nn.Module):
    """Id-score features (items the user clicked and tags they follow, each id with a
    score such as recency) pooled by a weighted EmbeddingBagCollection, dense features
    through a bottom layer, a shared layer and two heads. Outputs ``click`` and
    ``purchase`` [B, 1] logits.

    Features: clicked_items, followed_tags, candidate (all weighted: send a score per id).
    ``loss`` sums both heads' binary cross-entropy (one label here: purchases of clicks
    would be the second in real data); evaluation scores ``click``.
    """

    eval_output = "click"

    def __init__(self, num_items: int = 5000, num_tags: int = 300, dim: int = 16, num_dense: int = 8,
                 hidden: int = 32, device: Optional[str] = None) -> None:
        super().__init__()
        self.num_dense = num_dense
        self.sparse = EmbeddingBagCollection([
            EmbeddingBagConfig(name="item_table", num_embeddings=num_items, embedding_dim=dim,
                               feature_names=["clicked_items", "candidate"], pooling=PoolingType.MEAN),
            EmbeddingBagConfig(name="tag_table", num_embeddings=num_tags, embedding_dim=dim, feature_names=["followed_tags"]),
        ], is_weighted=True, device=device)
        self.bottom = nn.Linear(num_dense, dim)
        self.shared = nn.Sequential(nn.Linear(4 * dim, hidden), nn.ReLU())
        self.click = nn.Linear(hidden, 1)
        self.purchase = nn.Linear(hidden, 1)
        if device != "meta":
            with torch.no_grad():
                for p in self.parameters():
                    if p.dim() == 2:
                        nn.init.normal_(p, 0, 0.1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        pooled = self.sparse(features).values()
        x = self.shared(torch.cat([pooled, torch.relu(self.bottom(dense))], dim=1))
        return {"click": self.click(x), "purchase": self.purchase(x)}

    def loss(self, outputs: Dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        bce = nn.functional.binary_cross_entropy_with_logits
        return bce(outputs["click"].view(-1), labels) + bce(outputs["purchase"].view(-1), labels)


class MixedRanker(MultiTaskRanker):
    """MultiTaskRanker plus plain (unweighted) features in an EmbeddingBagCollection of their own:
    the user's country and device type. Requests send weights for the id-score features only.

    Features: clicked_items, followed_tags, candidate (weighted), country, device_type (unweighted).
    """

    def __init__(self, num_items: int = 5000, num_tags: int = 300, dim: int = 16, num_dense: int = 8,
                 hidden: int = 32, num_countries: int = 50, device: Optional[str] = None) -> None:
        super().__init__(num_items, num_tags, dim, num_dense, hidden, device)
        self.context = EmbeddingBagCollection([
            EmbeddingBagConfig(name="country_table", num_embeddings=num_countries, embedding_dim=dim, feature_names=["country"]),
            EmbeddingBagConfig(name="device_table", num_embeddings=8, embedding_dim=dim, feature_names=["device_type"]),
        ], device=device)
        self.shared = nn.Sequential(nn.Linear(6 * dim, hidden), nn.ReLU())
        if device != "meta":
            with torch.no_grad():
                first = self.shared[0]
                assert isinstance(first, nn.Linear)
                nn.init.normal_(first.weight, 0, 0.1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        pooled = torch.cat([self.sparse(features).values(), self.context(features).values()], dim=1)
        x = self.shared(torch.cat([pooled, torch.relu(self.bottom(dense))], dim=1))
        return {"click": self.click(x), "purchase": self.purchase(x)}
