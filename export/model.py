"""The exported module: plain tensors in, named outputs out.

    forward(dense [B, n_dense] float32,
            lengths [F * B] int32   (feature-major, in the manifest's feature order),
            values [N] int64,
            weights Optional[[N] float32]) -> Dict[str, Tensor]   (batch first)

A DLRM answers {"logit": [B, 1], "prob": [B, 1]}; an embedding-only model answers
each feature's pooled embedding [B, dim] (its ``dense`` input is [B, 0]).
Inside, the quantized, inference-sharded tables run as a ``FlatPooledLookup`` on the
request tensors themselves (no KeyedJaggedTensor is built); callers need no recship
classes. The same modules are what torch.export / AOTInductor compile.
"""

import warnings
from typing import TYPE_CHECKING, Dict, List, Optional

import torch
from torch import nn

from recship.fx import symbolic_trace
from recship.quantize.flat import FlatPooledLookup
from recship.sparse import KeyedJaggedTensor

if TYPE_CHECKING:
    from recship.trainer.dlrm import DLRM


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
    """A DLRM whose sparse arch is quantized and sharded for inference.

    Args:
        dlrm: the DLRM (its dense layers are used; its sparse arch is not called).
        lookup: the flat lookup of its quantized, sharded tables (features in table order).
        device: where the dense layers (and the merged embeddings) live.
    """

    _feature_names: List[str]

    def __init__(self, dlrm: "DLRM", lookup: FlatPooledLookup, device: str = "cpu") -> None:
        super().__init__()
        self.model = dlrm
        self.lookup = lookup
        self._feature_names = list(lookup.feature_names)
        self._device = device

    def forward(
        self, dense: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor, weights: Optional[torch.Tensor] = None
    ) -> Dict[str, torch.Tensor]:
        pooled = self.lookup(lengths, values, weights)
        logit = self.model.predict(dense.to(torch.device(self._device)), pooled).unsqueeze(1)
        return {"logit": logit, "prob": torch.sigmoid(logit)}


class ExportedEmbeddings(nn.Module):
    """An embedding-only model: each feature's pooled embedding."""

    def __init__(self, lookup: FlatPooledLookup) -> None:
        super().__init__()
        self.lookup = lookup
        self._feature_names = list(lookup.feature_names)
        self._dims = list(lookup.dims)

    def forward(
        self, dense: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor, weights: Optional[torch.Tensor] = None
    ) -> Dict[str, torch.Tensor]:
        pooled = self.lookup(lengths, values, weights)
        out: Dict[str, torch.Tensor] = {}
        col = 0
        for name, dim in zip(self._feature_names, self._dims):
            out[name] = pooled[:, col : col + dim]
            col += dim
        return out


def trace_and_script(module: nn.Module) -> torch.jit.ScriptModule:
    """fx-trace with the lookup modules as leaves, then TorchScript the traced graph."""
    with warnings.catch_warnings():
        # torch's own fx GraphModule.__init__ trips TorchScript's annotation checker: not the user's business
        warnings.filterwarnings("ignore", message=r".*instance-level annotations on empty non-base types.*", category=UserWarning)
        return torch.jit.script(symbolic_trace(module))
