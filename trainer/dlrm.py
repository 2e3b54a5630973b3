"""DLRM: dense MLP + embedding tables + pairwise dot interaction + over MLP -> one logit.

    dense [B, num_dense] --dense_arch--> [B, D] --+
    sparse KJT --EmbeddingBagCollection--> F x [B, D] --+--> dot products of all pairs
                                                          (upper triangle) ++ dense [B, D]
                                                          --over_arch--> logit [B]
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

import torch
from torch import nn

from recship.names import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE
from recship.sparse import KeyedJaggedTensor
from recship.modules.embedding_configs import EmbeddingBagConfig
from recship.modules.embedding_modules import EmbeddingBagCollection
from recship.modules.types import PoolingType



@dataclass
class DLRMConfig:
    """Shape of a DLRM.

    Args:
        num_embeddings_per_feature: rows of each sparse feature's table (one
            table per feature, named ``t_<feature>``).
        embedding_dim: width of every table and of the dense arch's output.
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
            raise ValueError(
                f"{len(self.sparse_feature_names)} feature names for "
                f"{len(self.num_embeddings_per_feature)} tables"
            )

    def tables(self) -> List[EmbeddingBagConfig]:
        return [
            EmbeddingBagConfig(
                name=f"t_{name}",
                num_embeddings=rows,
                embedding_dim=self.embedding_dim,
                feature_names=[name],
                pooling=PoolingType.SUM,
            )
            for name, rows in zip(self.sparse_feature_names or [], self.num_embeddings_per_feature)
        ]


def _mlp(widths: List[int], device, final_activation: bool) -> nn.Sequential:
    layers: List[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1], device=device))
        if i < len(widths) - 2 or final_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """forward(dense [B, num_dense] float32, sparse KJT) -> logit [B]."""

    def __init__(self, config: DLRMConfig, device: Optional[Union[str, torch.device]] = None) -> None:
        super().__init__()
        self.config = config
        self.num_dense = config.num_dense  # the model contract's dense width (recship.export.any_model)
        d = config.embedding_dim
        f = len(config.num_embeddings_per_feature)
        self.dense_arch = _mlp([config.num_dense] + config.dense_arch + [d], device, final_activation=True)
        self.sparse_arch = EmbeddingBagCollection(config.tables(), device=device)
        num_pairs = (f + 1) * f // 2
        self.over_arch = _mlp([d + num_pairs] + config.over_arch + [1], device, final_activation=False)
        self._num_vectors = f + 1
        self._register_load_state_dict_pre_hook(self._accept_torchrec_keys)

    eval_output = "logit"  # the served output that export measures AUC and log loss on

    def _torchrec_names(self) -> Dict[str, str]:
        """This model's parameter names -> those of TorchRec's ``DLRM`` of the same shape (``recship.models.dlrm``:
        ``dense_arch.model._mlp.<i>._linear``, ``sparse_arch.embedding_bag_collection``, ``over_arch.model.0._mlp.<i>
        ._linear`` and the last layer ``over_arch.model.1``). The math is the same: TorchRec's DLRM with tables
        ``t_<feature>`` computes this model's logit as [B, 1]."""
        names = {f"sparse_arch.embedding_bags.{t.name}.weight": f"sparse_arch.embedding_bag_collection.embedding_bags.{t.name}.weight"
                 for t in self.config.tables()}
        for arch, head in (("dense_arch", "dense_arch.model._mlp"), ("over_arch", "over_arch.model.0._mlp")):
            linears = [i for i, m in enumerate(getattr(self, arch)) if isinstance(m, nn.Linear)]
            for k, index in enumerate(linears):
                last = arch == "over_arch" and k == len(linears) - 1
                for p in ("weight", "bias"):
                    names[f"{arch}.{index}.{p}"] = f"over_arch.model.1.{p}" if last else f"{head}.{k}._linear.{p}"
        return names

    def torchrec_state_dict(self) -> Dict[str, torch.Tensor]:
        """``state_dict()`` under TorchRec's DLRM names (see ``_torchrec_names``): what TorchRec's ``DLRM`` of the same
        tables and widths loads strictly."""
        names = self._torchrec_names()
        return {names[k]: v for k, v in self.state_dict().items()}

    def _accept_torchrec_keys(self, state_dict: Dict[str, torch.Tensor], prefix: str, *args: object) -> None:
        """load_state_dict pre-hook: a TorchRec DLRM's keys (``torchrec_state_dict``) are renamed to this model's in
        place, so its state_dict loads (strict or not) as this model's own does."""
        for ours, theirs in self._torchrec_names().items():
            if prefix + theirs in state_dict:
                if prefix + ours in state_dict:
                    raise ValueError(f"the state_dict has both {prefix + ours!r} and TorchRec's name for it, {prefix + theirs!r}")
                state_dict[prefix + ours] = state_dict.pop(prefix + theirs)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.predict(dense, self.sparse_arch(sparse).values())

    def serving_outputs(self, logit: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The exported model's outputs (``recship.export.model``): logit and prob, [B, 1] each."""
        logit = logit.unsqueeze(1)
        return {"logit": logit, "prob": torch.sigmoid(logit)}

    def predict(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The logit [B] from dense features [B, num_dense] and the pooled embeddings [B, F * D]
        (features in table order): everything after the lookups."""
        dense_emb = self.dense_arch(dense)  # [B, D]
        b = dense_emb.shape[0]
        stacked = torch.cat([dense_emb.unsqueeze(1), pooled.view(b, -1, dense_emb.shape[1])], dim=1)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))  # [B, F + 1, F + 1]
        # upper triangle without the diagonal: every unordered pair once
        n = self._num_vectors
        if torch.compiler.is_compiling():
            # torch.export / AOTInductor: row slices and one cat become contiguous copies; inductor's
            # code for the gather below is 8x slower than aten's at batch 512
            pairs = torch.cat([dots[:, i, i + 1 :] for i in range(n - 1)], dim=1)
        else:
            pair = torch.triu_indices(n, n, offset=1, device=dots.device)
            pairs = dots.reshape(b, n * n).index_select(1, pair[0] * n + pair[1])  # one gather; 2-D fancy indexing is slow
        return self.over_arch(torch.cat([dense_emb, pairs], dim=1)).squeeze(1)
