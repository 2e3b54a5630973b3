"""Models that break recship's model contract the way authors do (tests/trainer/test_train_mistakes.py): each must
cost one line and exit code 2 at `recship train`, before any rank starts."""

from typing import Optional

import torch
from torch import nn

from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig


class _Base(nn.Module):
    num_dense = 4

    def __init__(self, device: Optional[str] = None, dim: int = 8) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection([
            EmbeddingBagConfig(name="t_user", embedding_dim=dim, num_embeddings=100_000_000, feature_names=["user"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=dim, num_embeddings=80, feature_names=["item"]),
        ], device=device)
        self.dense = nn.Linear(self.num_dense, dim, device=device)

    def score(self, dense, features):
        pooled = self.ebc(features).to_dict()
        return ((pooled["user"] * pooled["item"]) + self.dense(dense)).sum(1)


class Branchy(_Base):
    def forward(self, dense, features):
        score = self.score(dense, features)
        if score.sum() > 0:  # a Python branch on a tensor's value
            return score
        return -score


class Swapped(_Base):
    def forward(self, features, dense):
        return self.score(dense, features)


class TupleOut(_Base):
    def forward(self, dense, features):
        score = self.score(dense, features)
        return score, score


class WrongDense(_Base):
    num_dense = 6  # the Linear takes 4

    def __init__(self, device: Optional[str] = None) -> None:
        super().__init__(device)
        self.dense = nn.Linear(4, 8, device=device)

    def forward(self, dense, features):
        return self.score(dense, features)


class TwoOutputs(_Base):
    def forward(self, dense, features):
        score = self.score(dense, features)
        return {"click": score, "buy": score * 2}


class OddDim(_Base):
    def __init__(self, device: Optional[str] = None) -> None:
        super().__init__(device, dim=6)

    def forward(self, dense, features):
        return self.score(dense, features)


class ScalarOut(_Base):
    def forward(self, dense, features):
        return self.score(dense, features).mean()


class WideOut(_Base):
    def forward(self, dense, features):
        pooled = self.ebc(features).to_dict()
        return pooled["user"] + self.dense(dense)  # [B, 8]: not one logit per example, and no loss()


def build(kind: str, device: Optional[str] = None) -> nn.Module:
    return globals()[kind](device=device)
