"""TorchRec's DLRM family (``torchrec.models.dlrm``): ``DLRM``, ``DLRM_DCN``, ``DLRM_Projection``, ``DLRMTrain``,
``DLRMWrapper`` and their archs (``SparseArch``, ``DenseArch``, ``InteractionArch``, ``InteractionDCNArch``,
``InteractionProjectionArch``, ``OverArch``), with TorchRec's constructors, forward math and parameter names, so a
TorchRec DLRM's state_dict loads strictly here and back::

    sparse_arch.embedding_bag_collection.embedding_bags.<table>.weight   [rows, D]
    dense_arch.model._mlp.<i>._linear.weight / .bias                     the dense MLP (ReLU after every layer)
    inter_arch.crossnet.{W_kernels,V_kernels,bias}.<l>                    DLRM_DCN only
    over_arch.model.0._mlp.<i>._linear.weight / .bias                    the over MLP but its last layer (ReLU)
    over_arch.model.1.weight / .bias                                     the last layer (no activation)

    dense [B, num_dense] --dense_arch--> [B, D] --+
    KJT --sparse_arch--> [B, F, D] --------------+--inter_arch--> [B, D + F + F(F-1)/2] --over_arch--> logits [B, out]

The built-in DLRM, what ``recship train`` trains without ``--model``, is this ``DLRM`` too: ``BuiltinDLRM`` (one
table per feature, outputs ``logit`` and ``prob``), built by the entry point ``recship.models.dlrm:builtin``.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from recship.models.layers import MLP, LowRankCrossNet
from recship.modules import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from recship.names import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE
from recship.sparse import KeyedJaggedTensor


def choose(n: int, k: int) -> int:
    """n choose k (0 when k is outside [0, n])."""
    if not 0 <= k <= n:
        return 0
    result = 1
    for i in range(1, min(k, n - k) + 1):
        result = result * (n - i + 1) // i
    return result


class SparseArch(nn.Module):
    """The embedding lookups: the collection's pooled embeddings stacked by feature (features in the order of the
    tables, then of each table's ``feature_names``). forward(KJT of B examples) -> [B, F, D]."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        if not configs:
            raise ValueError("SparseArch: the EmbeddingBagCollection has no tables")
        self.embedding_bag_collection = embedding_bag_collection
        self.D: int = configs[0].embedding_dim
        self._sparse_feature_names: List[str] = [f for c in configs for f in c.feature_names]
        self.F: int = len(self._sparse_feature_names)

    @property
    def sparse_feature_names(self) -> List[str]:
        return self._sparse_feature_names

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """KJT -> [B, F, D]."""
        pooled = self.embedding_bag_collection(features).to_dict()
        return torch.cat([pooled[name] for name in self._sparse_feature_names], dim=1).reshape(-1, self.F, self.D)


class DenseArch(nn.Module):
    """The dense features' MLP (``model``, ReLU after every layer): [B, in_features] -> [B, layer_sizes[-1]]."""

    def __init__(self, in_features: int, layer_sizes: List[int], device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.model = MLP(in_features, layer_sizes, bias=True, activation="relu", device=device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[B, in_features] -> [B, layer_sizes[-1]]."""
        return self.model(features)


def _stack(dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
    """[B, D] and [B, F, D] -> [B, F + 1, D], the dense vector first."""
    return torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)


class InteractionArch(nn.Module):
    """DLRM's pairwise dot products: with the dense vector first, the dots of every pair (i < j) of the F + 1 vectors
    in row-major upper-triangle order, after the dense vector: [B, D], [B, F, D] -> [B, D + F + F(F-1)/2]."""

    triu_indices: torch.Tensor  # [2, (F + 1) F / 2], a buffer left out of the state_dict, as TorchRec's (forward makes its own)

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        self.F: int = num_sparse_features
        self.register_buffer("triu_indices", torch.triu_indices(self.F + 1, self.F + 1, offset=1), persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        """[B, D], [B, F, D] -> [B, D + F + F(F-1)/2]."""
        if self.F <= 0:
            return dense_features
        stacked = _stack(dense_features, sparse_features)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))  # [B, F + 1, F + 1]
        n = self.F + 1
        if torch.compiler.is_compiling():
            # torch.export / AOTInductor: row slices and one cat become contiguous copies; inductor's code for the
            # gather below is 8x slower than aten's at batch 512
            pairs = torch.cat([dots[:, i, i + 1:] for i in range(n - 1)], dim=1)
        else:  # one gather over the flattened matrix: 2-D fancy indexing (dots[:, rows, cols]) is slower. The
            # indices are made here, not read from the buffer: a model built on the meta device and materialized
            # (to_empty, as the trainer does) holds garbage in its non-persistent buffers
            pair = torch.triu_indices(n, n, offset=1, device=dots.device)
            pairs = dots.reshape(-1, n * n).index_select(1, pair[0] * n + pair[1])
        return torch.cat((dense_features, pairs), dim=1)


class InteractionDCNArch(nn.Module):
    """DLRM_DCN's interaction: ``crossnet`` over the flattened [dense vector, sparse vectors]:
    [B, D], [B, F, D] -> [B, (F + 1) * D]."""

    def __init__(self, num_sparse_features: int, crossnet: nn.Module) -> None:
        super().__init__()
        self.F: int = num_sparse_features
        self.crossnet = crossnet

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        """[B, D], [B, F, D] -> [B, (F + 1) * D]."""
        if self.F <= 0:
            return dense_features
        return self.crossnet(_stack(dense_features, sparse_features).reshape([dense_features.shape[0], -1]))


class InteractionProjectionArch(nn.Module):
    """DLRM_Projection's interaction: two branches over the flattened [dense, sparse] vectors, Y [B, F1 * D] and
    Z [B, D * F2], and their product Y Z per example after the dense vector: -> [B, D + F1 * F2]."""

    def __init__(self, num_sparse_features: int, interaction_branch1: nn.Module, interaction_branch2: nn.Module) -> None:
        super().__init__()
        self.F: int = num_sparse_features
        self.interaction_branch1 = interaction_branch1
        self.interaction_branch2 = interaction_branch2

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        """[B, D], [B, F, D] -> [B, D + F1 * F2]."""
        if self.F <= 0:
            return dense_features
        b, d = dense_features.shape
        flat = torch.reshape(_stack(dense_features, sparse_features), (b, -1))
        y = self.interaction_branch1(flat).reshape([b, -1, d])
        z = self.interaction_branch2(flat).reshape([b, d, -1])
        return torch.cat((dense_features, torch.reshape(torch.bmm(y, z), (b, -1))), dim=1)


class OverArch(nn.Module):
    """The top MLP (``model``): an MLP of ``layer_sizes[:-1]`` (ReLU after each) then a plain linear layer to
    ``layer_sizes[-1]``: [B, in_features] -> [B, layer_sizes[-1]]."""

    def __init__(self, in_features: int, layer_sizes: List[int], device: Optional[torch.device] = None) -> None:
        super().__init__()
        if len(layer_sizes) <= 1:
            raise ValueError(f"OverArch must have multiple layers, got layer_sizes={layer_sizes}")
        self.model = nn.Sequential(
            MLP(in_features, layer_sizes[:-1], bias=True, activation="relu", device=device),
            nn.Linear(layer_sizes[-2], layer_sizes[-1], bias=True, device=device),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[B, in_features] -> [B, layer_sizes[-1]]."""
        return self.model(features)


class DLRM(nn.Module):
    """DLRM (arXiv:1906.00091) as TorchRec builds it. forward(dense_features [B, dense_in_features] float,
    sparse_features KJT) -> logits [B, over_arch_layer_sizes[-1]].

    Args:
        embedding_bag_collection: the tables; all of one embedding_dim D.
        dense_in_features: width of the dense features (also ``num_dense``, the export contract's).
        dense_arch_layer_sizes: the dense MLP's widths; the last must be D.
        over_arch_layer_sizes: the over arch's widths (at least two).
        dense_device: device of the dense parameters.
    """

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, dense_in_features: int,
                 dense_arch_layer_sizes: List[int], over_arch_layer_sizes: List[int],
                 dense_device: Optional[torch.device] = None) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        if not configs:
            raise ValueError("DLRM needs at least one embedding bag")
        dims = sorted({c.embedding_dim for c in configs})
        if len(dims) != 1:
            raise ValueError(f"all EmbeddingBagConfigs of a DLRM must have the same embedding_dim, got {dims}")
        if not dense_arch_layer_sizes or dense_arch_layer_sizes[-1] != dims[0]:
            raise ValueError(f"the dense arch's last layer size ({dense_arch_layer_sizes[-1:]}) must equal "
                             f"the embedding_dim ({dims[0]})")
        self.num_dense = dense_in_features  # recship's export contract (recship.export.any_model)
        self.sparse_arch = SparseArch(embedding_bag_collection)
        f = len(self.sparse_arch.sparse_feature_names)
        self.dense_arch = DenseArch(dense_in_features, dense_arch_layer_sizes, device=dense_device)
        self.inter_arch: nn.Module = InteractionArch(num_sparse_features=f)
        self.over_arch = OverArch(dims[0] + choose(f, 2) + f, over_arch_layer_sizes, device=dense_device)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """[B, dense_in_features], KJT -> logits [B, over_arch_layer_sizes[-1]]."""
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_features)
        return self.over_arch(self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse))


class DLRM_Projection(DLRM):
    """DLRM with an InteractionProjectionArch: two DenseArch branches (``interaction_branch{1,2}_layer_sizes``, each
    ending in a multiple of D) over the flattened [dense, sparse] vectors; the over arch reads D + F1 * F2."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, dense_in_features: int,
                 dense_arch_layer_sizes: List[int], over_arch_layer_sizes: List[int],
                 interaction_branch1_layer_sizes: List[int], interaction_branch2_layer_sizes: List[int],
                 dense_device: Optional[torch.device] = None) -> None:
        super().__init__(embedding_bag_collection, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes,
                         dense_device)
        d = self.sparse_arch.D
        f = len(self.sparse_arch.sparse_feature_names)
        for name, sizes in (("branch1", interaction_branch1_layer_sizes), ("branch2", interaction_branch2_layer_sizes)):
            if sizes[-1] % d:
                raise ValueError(f"the final interaction {name} layer size ({sizes[-1]}) is not a multiple of the "
                                 f"embedding size ({d})")
        in_features = f * d + dense_arch_layer_sizes[-1]
        self.inter_arch = InteractionProjectionArch(
            f, DenseArch(in_features, interaction_branch1_layer_sizes, device=dense_device),
            DenseArch(in_features, interaction_branch2_layer_sizes, device=dense_device))
        projected = (interaction_branch1_layer_sizes[-1] // d) * (interaction_branch2_layer_sizes[-1] // d)
        self.over_arch = OverArch(d + projected, over_arch_layer_sizes, device=dense_device)


class DLRM_DCN(DLRM):
    """DLRM with a DCN-v2 interaction: a LowRankCrossNet (``dcn_num_layers`` layers of rank ``dcn_low_rank_dim``)
    over the flattened [dense, sparse] vectors; the over arch reads (F + 1) * D."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, dense_in_features: int,
                 dense_arch_layer_sizes: List[int], over_arch_layer_sizes: List[int], dcn_num_layers: int,
                 dcn_low_rank_dim: int, dense_device: Optional[torch.device] = None) -> None:
        super().__init__(embedding_bag_collection, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes,
                         dense_device)
        d = self.sparse_arch.D
        f = len(self.sparse_arch.sparse_feature_names)
        crossnet = LowRankCrossNet(in_features=(f + 1) * d, num_layers=dcn_num_layers, low_rank=dcn_low_rank_dim)
        self.inter_arch = InteractionDCNArch(f, crossnet)
        self.over_arch = OverArch((f + 1) * d, over_arch_layer_sizes, device=dense_device)


class DLRMTrain(nn.Module):
    """A DLRM with its loss, for training loops over ``Batch`` (``dense_features``, ``sparse_features``, ``labels``):
    forward(batch) -> (loss, (loss, logits [B], labels [B])), the inner three detached; the loss is
    BCEWithLogitsLoss of the logits squeezed on the last dim against the labels as float. The DLRM is ``model``."""

    def __init__(self, dlrm_module: DLRM) -> None:
        super().__init__()
        self.model = dlrm_module
        self.loss_fn: nn.Module = nn.BCEWithLogitsLoss()

    def forward(self, batch: Any) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """batch (a ``recship.datasets.Batch`` or anything with its three fields) -> (loss, (loss, logits, labels))."""
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


class DLRMWrapper(DLRM):
    """A DLRM taking one ``ModelInput`` (TorchRec's test-model batch: ``float_features`` [B, dense_in_features],
    ``idlist_features`` KJT, ``label`` [B] float). forward(model_input) -> in training, (loss, logits [B, out]): the
    loss is binary cross-entropy with logits of ``logits.squeeze()`` against ``label``; in eval, the logits."""

    def forward(self, model_input: Any) -> Any:  # type: ignore[override]
        """ModelInput -> (loss, logits) when training, else logits [B, over_arch_layer_sizes[-1]]."""
        pred = super().forward(dense_features=model_input.float_features, sparse_features=model_input.idlist_features)
        if self.training:
            return torch.nn.functional.binary_cross_entropy_with_logits(pred.squeeze(), model_input.label), pred
        return pred


@dataclass
class DLRMConfig:
    """The built-in DLRM's shape: one table per sparse feature, named ``t_<feature>``, all ``embedding_dim`` wide.

    Args:
        num_embeddings_per_feature: rows of each sparse feature's table.
        embedding_dim: width of every table and of the dense arch's output (a multiple of 4: fbgemm's kernels).
        num_dense: dense input features.
        dense_arch: hidden widths of the dense MLP (its output is embedding_dim).
        over_arch: hidden widths of the over MLP (its output is one logit).
        sparse_feature_names: feature names; default cat_0 .. cat_{n-1}.
    """

    num_embeddings_per_feature: List[int] = field(default_factory=lambda: [1000] * CRITEO_NUM_SPARSE)
    embedding_dim: int = 16
    num_dense: int = CRITEO_NUM_DENSE
    dense_arch: List[int] = field(default_factory=lambda: [64])
    over_arch: List[int] = field(default_factory=lambda: [64, 32])
    sparse_feature_names: Optional[List[str]] = None

    def __post_init__(self) -> None:
        if not self.num_embeddings_per_feature:
            raise ValueError("a DLRM needs at least one sparse feature")
        if self.embedding_dim % 4 != 0:
            raise ValueError(f"embedding_dim must be a multiple of 4 (fbgemm kernels), got {self.embedding_dim}")
        if self.sparse_feature_names is None:
            self.sparse_feature_names = [f"cat_{i}" for i in range(len(self.num_embeddings_per_feature))]
        if len(self.sparse_feature_names) != len(self.num_embeddings_per_feature):
            raise ValueError(f"{len(self.sparse_feature_names)} feature names for {len(self.num_embeddings_per_feature)} tables")

    def tables(self) -> List[EmbeddingBagConfig]:
        return [EmbeddingBagConfig(name=f"t_{name}", num_embeddings=rows, embedding_dim=self.embedding_dim,
                                   feature_names=[name], pooling=PoolingType.SUM)
                for name, rows in zip(self.sparse_feature_names or [], self.num_embeddings_per_feature)]


class BuiltinDLRM(DLRM):
    """The built-in DLRM, what ``recship train`` trains without ``--model`` (entry point ``builtin``): TorchRec's
    ``DLRM`` over ``config.tables()`` with dense MLP ``config.dense_arch + [D]`` and over MLP ``config.over_arch + [1]``,
    its parameters under TorchRec's names. forward(dense [B, num_dense], KJT) -> logit [B] (the trained output); the
    artifact serves ``logit`` and ``prob`` [B, 1] (``serving_outputs``).
    """

    eval_output = "logit"  # the served output that export measures AUC and log loss on

    def __init__(self, config: DLRMConfig, device: Optional[Union[str, torch.device]] = None) -> None:
        d = config.embedding_dim
        super().__init__(EmbeddingBagCollection(config.tables(), device=torch.device(device) if device else None),
                         dense_in_features=config.num_dense, dense_arch_layer_sizes=[*config.dense_arch, d],
                         over_arch_layer_sizes=[*config.over_arch, 1],
                         dense_device=torch.device(device) if device else None)
        self.config = config

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """[B, num_dense], KJT -> logit [B]."""
        return super().forward(dense_features, sparse_features).squeeze(1)

    def serving_outputs(self, logit: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The artifact's outputs (``recship.export.model``): logit and prob, [B, 1] each."""
        logit = logit.unsqueeze(1)
        return {"logit": logit, "prob": torch.sigmoid(logit)}


def builtin(num_embeddings_per_feature: Optional[List[int]] = None, embedding_dim: int = 16,
            dense_arch: Optional[List[int]] = None, over_arch: Optional[List[int]] = None,
            device: Optional[str] = None) -> BuiltinDLRM:
    """The built-in DLRM's entry point (``recship.models.dlrm:builtin``, what ``recship train`` trains without
    ``--model``): 13 dense and 26 categorical Criteo features by default, a ``BuiltinDLRM``."""
    config = DLRMConfig(num_embeddings_per_feature=num_embeddings_per_feature or [1000] * CRITEO_NUM_SPARSE,
                        embedding_dim=embedding_dim, dense_arch=dense_arch or [64], over_arch=over_arch or [64, 32])
    return BuiltinDLRM(config, device=device)


__all__ = ["BuiltinDLRM", "DLRM", "DLRMConfig", "DLRMTrain", "DLRMWrapper", "DLRM_DCN", "DLRM_Projection", "DenseArch", "InteractionArch", "InteractionDCNArch",
           "InteractionProjectionArch", "OverArch", "SparseArch", "builtin", "choose"]
