"""Example models that follow recship's model contract (see ``recship.export.any_model``).

``forward(dense, features)``: dense float32 [B, num_dense], features a KeyedJaggedTensor;
returns a Tensor or a Dict[str, Tensor], batch first. Each is exported, served and run
from C++ by the tests exactly as a user's own model would be.
"""

from typing import List, Optional

from torch import nn

from recship.models.ranker import MixedRanker, MultiTaskRanker
from recship.models.two_tower import TwoTower


def dlrm(num_embeddings_per_feature: Optional[List[int]] = None, embedding_dim: int = 16, dense_arch: Optional[List[int]] = None,
         over_arch: Optional[List[int]] = None, device: Optional[str] = None) -> nn.Module:
    """The built-in DLRM (``recship.models:dlrm``): 13 dense and 26 categorical Criteo features."""
    from recship.trainer.dlrm import DLRM, DLRMConfig

    config = DLRMConfig(num_embeddings_per_feature=num_embeddings_per_feature or [1000] * 26, embedding_dim=embedding_dim,
                        dense_arch=dense_arch or [64], over_arch=over_arch or [64, 32])
    return DLRM(config, device=device)


__all__ = ["MixedRanker", "MultiTaskRanker", "TwoTower", "dlrm"]
