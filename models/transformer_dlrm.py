"""TorchRec's experimental transformer DLRM (``torchrec.models.experimental.transformerdlrm``): a DLRM whose interaction
is a ``nn.TransformerEncoder`` over the dense vector and the F sparse vectors, with TorchRec's constructors,
parameter names (``inter_arch.interarch_TE.layers.<i>.*``, torch's encoder-layer names) and outputs::

    dense [B, num_dense] --dense_arch--> [B, D] --+
    KJT --sparse_arch--> [B, F, D] --------------+--stack [B, F + 1, D]--encoder--> [B, (F + 1) D] --over_arch--> [B, out]

As TorchRec's, the encoder layers are torch's defaults (feed-forward width 2048, dropout 0.1, ReLU) and read the
stacked [B, F + 1, D] tensor with ``batch_first=False``: dimension 0, the batch, is the sequence, so attention mixes
the examples of a batch (an example's output depends on the others in its batch), each of the F + 1 slots being one
sequence. TorchRec's numbers need that; ``batch_first=True`` (a recship keyword) attends over each example's F + 1
vectors instead.
"""

from typing import List, Optional

import torch
from torch import nn

from recship.models.dlrm import DLRM, OverArch
from recship.trainer import EmbeddingBagCollection


class InteractionTransformerArch(nn.Module):
    """A transformer encoder over [dense vector, sparse vectors]: [B, D], [B, F, D] -> [B, (F + 1) * D].

    Args:
        num_sparse_features: F.
        embedding_dim: D, the encoder's model width (a multiple of ``nhead``).
        nhead: attention heads per layer.
        ntransformer_layers: encoder layers.
        batch_first: attend over each example's F + 1 vectors (False, TorchRec's: over the batch; see the module
            docstring).
    """

    def __init__(self, num_sparse_features: int, embedding_dim: int, nhead: int = 8, ntransformer_layers: int = 4,
                 *, batch_first: bool = False) -> None:
        super().__init__()
        if embedding_dim % nhead:
            raise ValueError(f"embedding_dim ({embedding_dim}) must be a multiple of nhead ({nhead})")
        self.F: int = num_sparse_features
        self.nhead = nhead
        self.ntransformer_layers = ntransformer_layers
        layer = nn.TransformerEncoderLayer(d_model=embedding_dim, nhead=nhead, batch_first=batch_first)
        self.interarch_TE = nn.TransformerEncoder(layer, num_layers=ntransformer_layers,
                                                  enable_nested_tensor=False)  # no padding mask: nested tensors never apply

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        """dense_features [B, D], sparse_features [B, F, D] -> [B, (F + 1) * D] (F = 0: the dense features)."""
        if self.F <= 0:
            return dense_features
        b = dense_features.shape[0]
        stacked = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        return torch.reshape(self.interarch_TE(stacked), (b, -1))


class DLRM_Transformer(DLRM):
    """DLRM with an InteractionTransformerArch; the over arch reads (F + 1) * D. forward(dense_features
    [B, dense_in_features], sparse_features KJT) -> logits [B, over_arch_layer_sizes[-1]].

    Args:
        embedding_bag_collection: the tables, all of one embedding_dim D (a multiple of ``nhead``).
        dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes, dense_device: as DLRM's.
        nhead: attention heads per encoder layer.
        ntransformer_layers: encoder layers.
        batch_first: see InteractionTransformerArch (False: TorchRec's).
    """

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, dense_in_features: int,
                 dense_arch_layer_sizes: List[int], over_arch_layer_sizes: List[int], nhead: int = 8,
                 ntransformer_layers: int = 4, dense_device: Optional[torch.device] = None, *,
                 batch_first: bool = False) -> None:
        super().__init__(embedding_bag_collection, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes,
                         dense_device)
        d = self.sparse_arch.D
        f = len(self.sparse_arch.sparse_feature_names)
        # built after DLRM's own over arch, as TorchRec's: the same seed gives the same weights
        self.inter_arch = InteractionTransformerArch(f, d, nhead=nhead, ntransformer_layers=ntransformer_layers,
                                                     batch_first=batch_first)
        self.over_arch = OverArch((f + 1) * d, over_arch_layer_sizes, device=dense_device)


__all__ = ["DLRM_Transformer", "InteractionTransformerArch"]
