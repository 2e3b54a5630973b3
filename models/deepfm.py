"""TorchRec's DeepFM model (``torchrec.models.deepfm``): ``SimpleDeepFMNN`` and its archs (``SparseArch``,
``DenseArch``, ``FMInteractionArch``, ``OverArch``), with TorchRec's constructors, forward math and parameter names,
so a TorchRec SimpleDeepFMNN's state_dict loads strictly here and back::

    sparse_arch.embedding_bag_collection.embedding_bags.<table>.weight   [rows, D]
    dense_arch.model.{0,2}.weight / .bias                                Linear(num_dense, hidden), Linear(hidden, D)
    inter_arch.deep_fm.dense_module.0.weight / .bias                     Linear(D + F * D, deep_fm_dimension)
    over_arch.model.0.weight / .bias                                     Linear(D + deep_fm_dimension + 1, 1)

    dense [B, num_dense] --dense_arch--> [B, D] ----------------+
    KJT --sparse_arch--> KeyedTensor (F features of D) ----------+--inter_arch--> [B, D + DI + 1] --over_arch--> [B, 1]

``inter_arch`` concatenates the dense embedding, the DeepFM deep term (ReLU(Linear) of every embedding flattened,
DI wide) and the factorization machine's second-order term (one column). ``over_arch`` ends in a sigmoid, as
TorchRec's: the model's output is a probability in (0, 1), not a logit.

The model follows recship's model contract (``forward(dense, features)``), so ``recship export`` exports it as it is.
"""

from typing import List, Tuple, Union

import torch
from torch import nn

from recship.models.layers import DeepFM, FactorizationMachine
from recship.models.model_input import ModelInput
from recship.sparse import KeyedJaggedTensor, KeyedTensor
from recship.trainer import EmbeddingBagCollection


class SparseArch(nn.Module):
    """The embedding lookups: forward(KJT of B examples) -> the collection's pooled KeyedTensor ([B, F * D], keyed
    by feature). The collection is ``embedding_bag_collection``, as TorchRec's."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__()
        self.embedding_bag_collection: EmbeddingBagCollection = embedding_bag_collection

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """features: a KJT of B examples -> KeyedTensor [B, sum of the features' dims]."""
        return self.embedding_bag_collection(features)


class DenseArch(nn.Module):
    """The dense features projected to the embedding width: ``ReLU(Linear(ReLU(Linear(x))))`` (``model.0`` and
    ``model.2``). [B, in_features] -> [B, embedding_dim]."""

    def __init__(self, in_features: int, hidden_layer_size: int, embedding_dim: int) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("hidden_layer_size", hidden_layer_size),
                            ("embedding_dim", embedding_dim)):
            if value < 1:
                raise ValueError(f"DenseArch: {name} must be at least 1, got {value}")
        self.model: nn.Module = nn.Sequential(
            nn.Linear(in_features, hidden_layer_size), nn.ReLU(), nn.Linear(hidden_layer_size, embedding_dim), nn.ReLU())

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[B, in_features] -> [B, embedding_dim]."""
        return self.model(features)


class FMInteractionArch(nn.Module):
    """DeepFM's interaction: the dense embedding [B, D], the deep term ``ReLU(Linear(fm_in_features,
    deep_fm_dimension))`` of [dense, each sparse feature] flattened (``deep_fm.dense_module.0``), and the factorization
    machine's second-order term over the same input, concatenated: [B, D + deep_fm_dimension + 1]. With no sparse
    feature it returns the dense embedding unchanged.

    Args:
        fm_in_features: the deep term's input width, D + the sum of the sparse features' widths.
        sparse_feature_names: the features read from the sparse KeyedTensor, in order (F).
        deep_fm_dimension: the deep term's width (DI).
    """

    def __init__(self, fm_in_features: int, sparse_feature_names: List[str], deep_fm_dimension: int) -> None:
        super().__init__()
        self.sparse_feature_names: List[str] = sparse_feature_names
        self.deep_fm = DeepFM(dense_module=nn.Sequential(nn.Linear(fm_in_features, deep_fm_dimension), nn.ReLU()))
        self.fm = FactorizationMachine()

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedTensor) -> torch.Tensor:
        """dense_features [B, D], sparse_features a KeyedTensor holding every name of ``sparse_feature_names``
        -> [B, D + DI + 1]."""
        if len(self.sparse_feature_names) == 0:
            return dense_features
        inputs: List[torch.Tensor] = [dense_features]
        for name in self.sparse_feature_names:
            inputs.append(sparse_features[name])
        return torch.cat([dense_features, self.deep_fm(inputs), self.fm(inputs)], dim=1)


class OverArch(nn.Module):
    """The head: ``sigmoid(Linear(in_features, 1))`` (``model.0``). [B, in_features] -> [B, 1] in (0, 1)."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.model: nn.Module = nn.Sequential(nn.Linear(in_features, 1), nn.Sigmoid())

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[B, in_features] -> [B, 1]."""
        return self.model(features)


class SimpleDeepFMNN(nn.Module):
    """TorchRec's DeepFM model: pooled embeddings of the sparse features, the dense features projected to the same
    width, their DeepFM interaction, and a sigmoid head (see the module docstring for the layout).

    Args:
        num_dense_features: dense input width.
        embedding_bag_collection: the tables; every table must have the same embedding_dim D.
        hidden_layer_size: the dense arch's hidden width.
        deep_fm_dimension: the deep interaction's width (DI).
    """

    def __init__(self, num_dense_features: int, embedding_bag_collection: EmbeddingBagCollection,
                 hidden_layer_size: int, deep_fm_dimension: int) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        if not configs:
            raise ValueError("SimpleDeepFMNN: the EmbeddingBagCollection has no tables; at least one is required")
        dims = sorted({c.embedding_dim for c in configs})
        if len(dims) > 1:
            raise ValueError(f"SimpleDeepFMNN: every table must have the same embedding_dim, got {dims} "
                             f"({[(c.name, c.embedding_dim) for c in configs]})")
        embedding_dim = dims[0]
        feature_names = [f for c in configs for f in c.feature_names]
        self.num_dense = num_dense_features  # recship's export contract (recship.export.any_model)
        fm_in_features = embedding_dim * (1 + len(feature_names))
        self.sparse_arch = SparseArch(embedding_bag_collection)
        self.dense_arch = DenseArch(in_features=num_dense_features, hidden_layer_size=hidden_layer_size,
                                    embedding_dim=embedding_dim)
        self.inter_arch = FMInteractionArch(fm_in_features=fm_in_features, sparse_feature_names=feature_names,
                                            deep_fm_dimension=deep_fm_dimension)
        self.over_arch = OverArch(embedding_dim + deep_fm_dimension + 1)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """dense_features [B, num_dense_features], sparse_features a KJT of B examples -> [B, 1] in (0, 1)."""
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_features)
        interaction = self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse)
        return self.over_arch(interaction)


class SimpleDeepFMNNWrapper(SimpleDeepFMNN):
    """SimpleDeepFMNN taking one batch object with TorchRec's ModelInput fields (``float_features`` [B, num_dense],
    ``idlist_features`` a KJT, ``label`` [B]): training, it returns ``(loss, prediction)`` with the loss
    ``binary_cross_entropy_with_logits(prediction.squeeze(), label)`` (TorchRec's, applied to the sigmoid's output);
    in eval, the prediction [B, 1]."""

    def forward(self, model_input: ModelInput) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:  # type: ignore[override]
        pred = super().forward(dense_features=model_input.float_features, sparse_features=model_input.idlist_features)
        if self.training:
            loss = nn.functional.binary_cross_entropy_with_logits(pred.squeeze(), model_input.label)
            return loss, pred
        return pred


__all__ = ["DeepFM", "DenseArch", "EmbeddingBagCollection", "FMInteractionArch", "FactorizationMachine",
           "KeyedJaggedTensor", "KeyedTensor", "ModelInput", "OverArch", "SimpleDeepFMNN", "SimpleDeepFMNNWrapper", "SparseArch"]
