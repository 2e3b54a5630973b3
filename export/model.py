"""The exported module: plain tensors in, named outputs out.

    forward(dense [B, n_dense] float32,
            lengths [F * B] int32   (feature-major, in the manifest's feature order),
            values [N] int64,
            weights Optional[[N] float32]) -> Dict[str, Tensor]   (batch first)

A DLRM answers {"logit": [B, 1], "prob": [B, 1]}; an embedding-only model answers
each feature's pooled embedding [B, dim] (its ``dense`` input is [B, 0]).
Inside, the KJT is rebuilt from the tensors and the quantized, inference-sharded
tables run; callers need no recship classes.
"""

from typing import Dict, List, Optional

import torch
from torch import nn

from recship.fx import symbolic_trace
from recship.sparse import KeyedJaggedTensor


@torch.fx.wrap
def build_kjt(
    keys: List[str], values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor]
) -> KeyedJaggedTensor:
    """The request's KJT (one fx node, so tracing records KJT methods, not their insides)."""
    if lengths.shape[0] % len(keys) != 0:
        raise ValueError(f"lengths has {lengths.shape[0]} entries, not a multiple of the {len(keys)} features")
    return KeyedJaggedTensor(
        keys=keys, values=values, weights=weights, lengths=lengths, offsets=None, stride=None, length_per_key=None
    )


class ExportedDLRM(nn.Module):
    """A DLRM whose sparse arch is quantized and sharded for inference."""

    _feature_names: List[str]

    def __init__(self, dlrm: nn.Module, feature_names: List[str], device: str = "cpu") -> None:
        super().__init__()
        self.model = dlrm
        self._feature_names = list(feature_names)
        self._device = device  # where the dense layers (and the merged embeddings) live

    def forward(
        self, dense: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor, weights: Optional[torch.Tensor] = None
    ) -> Dict[str, torch.Tensor]:
        sparse = build_kjt(self._feature_names, values, lengths, weights)
        logit = self.model(dense.to(torch.device(self._device)), sparse).unsqueeze(1)
        return {"logit": logit, "prob": torch.sigmoid(logit)}


class ExportedEmbeddings(nn.Module):
    """An embedding-only model: each feature's pooled embedding."""

    _feature_names: List[str]

    def __init__(self, sparse: nn.Module, feature_names: List[str]) -> None:
        super().__init__()
        self.sparse = sparse
        self._feature_names = list(feature_names)

    def forward(
        self, dense: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor, weights: Optional[torch.Tensor] = None
    ) -> Dict[str, torch.Tensor]:
        pooled = self.sparse(build_kjt(self._feature_names, values, lengths, weights))
        return pooled.to_dict()


def trace_and_script(module: nn.Module) -> torch.jit.ScriptModule:
    """fx-trace with TBE modules as leaves, then TorchScript the traced graph."""
    return torch.jit.script(symbolic_trace(module))
