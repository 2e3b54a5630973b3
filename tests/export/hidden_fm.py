"""A model written in ordinary PyTorch that TorchScript cannot compile and torch.export can: its forward builds
``torch.zeros(B, D)`` with ``B = dense.shape[0]`` (TorchScript's zeros takes one size list) and takes pooled
embeddings by feature name from the collection's output (``self.ebc(features)["user"]``). Exported, its artifact
has model.pt2 alone (tests/export/test_pt2_only.py)."""

from typing import Optional

import torch
from torch import nn

from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig


class HiddenFM(nn.Module):
    """A factorisation machine over three features plus a dense tower: [B, 1] logits."""

    num_dense = 3

    def __init__(self, dim: int = 8, device: Optional[str] = None) -> None:
        super().__init__()
        self.dim = dim
        self.ebc = EmbeddingBagCollection([
            EmbeddingBagConfig(name="t_user", embedding_dim=dim, num_embeddings=120, feature_names=["user"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=dim, num_embeddings=90, feature_names=["item", "seen"]),
        ], device=device)
        self.dense = nn.Linear(self.num_dense, dim, device=device)
        self.out = nn.Linear(dim, 1, device=device)

    def forward(self, dense: torch.Tensor, features) -> torch.Tensor:
        pooled = self.ebc(features)
        B = dense.shape[0]
        total = torch.zeros(B, self.dim)
        squares = torch.zeros(B, self.dim)
        for name in ("user", "item", "seen"):
            e = pooled[name]
            total = total + e
            squares = squares + e * e
        interaction = 0.5 * (total * total - squares)
        return self.out(interaction + torch.relu(self.dense(dense)))


def build(dim: int = 8, device: Optional[str] = None) -> HiddenFM:
    return HiddenFM(dim=dim, device=device)
