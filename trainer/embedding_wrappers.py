"""Thin wrappers around the embedding collections (TorchRec's debug_embedding_modules, pec_embedding_modules and
itep_embedding_modules).

``DebugEmbeddingBagCollection`` / ``DebugEmbeddingCollection`` build a collection (``ebc`` / ``ec``) and, with
``debug_mode=True``, pass every output through an identity whose backward raises RuntimeError naming the feature when
the gradient coming back holds a NaN or an Inf: the first place a bad gradient reaches the tables, found without
``torch.autograd.set_detect_anomaly``'s cost. ``PECEmbeddingCollection`` carries TorchRec's Prioritized Embedding
Communication setting (which ids overlap between batches, sent first by TorchRec's sharded version) on an
EmbeddingCollection and otherwise is it: recship's sharded collections have no PEC, so unsharded it is a plain
delegate, as TorchRec's unsharded module is. ``ITEPEmbeddingBagCollection`` / ``ITEPEmbeddingCollection`` pass the
features through an in-training pruning module, ``itep_module(features, iteration)``, before the lookup and count
iterations in an ``_iter`` buffer; TorchRec's pruning module itself (``GenericITEPModule``) is not in recship: its fbgemm
kernels (``init_address_lookup``, ``prune_embedding_tables``, ``remap_indices_update_utils``) are not in fbgemm_gpu
1.8.0's CPU build, so ``itep_module`` is the caller's.

state_dict keys are TorchRec's: ``ebc.embedding_bags.<table>.weight``, ``ec.embeddings.<table>.weight``,
``_embedding_collection.embeddings.<table>.weight``, ``_embedding_bag_collection.embedding_bags.<table>.weight``,
``_itep_module.*`` and ``_iter``.
"""

from enum import Enum
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection


class _GradCheck(torch.autograd.Function):
    """Identity forward; backward raises RuntimeError if the incoming gradient holds a NaN or an Inf."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tag: str) -> torch.Tensor:  # type: ignore[override]
        ctx.tag = tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:  # type: ignore[override]
        values = grad.coalesce().values() if grad.is_sparse else grad
        if not bool(torch.isfinite(values).all()):
            raise RuntimeError(f"NaN/Inf detected in gradient entering {ctx.tag}")
        return grad, None


def _waited(out: Any) -> Any:
    """A sharded collection's awaitable, waited; anything else as it is."""
    return out.wait() if hasattr(out, "wait") and callable(out.wait) else out


class DebugEmbeddingCollection(nn.Module):
    """An EmbeddingCollection (``ec``) whose outputs check their gradients in ``debug_mode``.

    Args:
        tables: one EmbeddingConfig per table.
        device: where to allocate the tables.
        debug_mode: wrap each output's values [N_f, D] so that a NaN/Inf gradient raises RuntimeError naming
            ``ec[<feature>].values``; False: the collection's output unchanged.
    """

    def __init__(self, tables: List[EmbeddingConfig], device: Optional[torch.device], debug_mode: bool = False) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=tables, device=device)
        self.debug_mode = debug_mode

    def _wrap_tensor(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        return _GradCheck.apply(t, tag) if self.debug_mode and t.requires_grad else t

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """KJT -> {feature: JaggedTensor of [N_f, D] rows}, as EmbeddingCollection's."""
        out = self.ec(features)
        if not self.debug_mode:
            return out
        return {
            name: JaggedTensor(values=self._wrap_tensor(jt.values(), f"ec[{name}].values"), lengths=jt.lengths(),
                               weights=jt.weights_or_none())
            for name, jt in _waited(out).items()
        }


class DebugEmbeddingBagCollection(nn.Module):
    """An EmbeddingBagCollection (``ebc``) whose outputs check their gradients in ``debug_mode``.

    Args:
        tables: one EmbeddingBagConfig per table.
        device: where to allocate the tables.
        debug_mode: wrap each feature's pooled [B, D_f] so that a NaN/Inf gradient raises RuntimeError naming
            ``ebc[<feature>].values``; False: the collection's output unchanged.
    """

    def __init__(self, tables: List[EmbeddingBagConfig], device: Optional[torch.device], debug_mode: bool = False) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=tables, device=device)
        self.embedding_bag_configs = self.ebc.embedding_bag_configs
        self.debug_mode = debug_mode

    def _wrap_tensor(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        return _GradCheck.apply(t, tag) if self.debug_mode and t.requires_grad else t

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """KJT -> KeyedTensor [B, sum of dims], as EmbeddingBagCollection's."""
        out = self.ebc(features)
        if not self.debug_mode:
            return out
        pooled = _waited(out)
        if not isinstance(pooled, KeyedTensor):
            raise TypeError(f"expected the collection to return a KeyedTensor, got {type(pooled).__name__}")
        per_feature = pooled.to_dict()
        return KeyedTensor.from_tensor_list(
            list(per_feature), [self._wrap_tensor(t, f"ebc[{name}].values") for name, t in per_feature.items()]
        )


class OverlappingCheckerType(Enum):
    """How PEC finds the ids two consecutive batches share (TorchRec's; BOOLEAN: a full boolean mask)."""

    BOOLEAN = "boolean"


class PECEmbeddingCollection(nn.Module):
    """An EmbeddingCollection carrying a Prioritized Embedding Communication setting; forward is the collection's.

    Args:
        embedding_collection: the collection (``embedding_collection``).
        checker_type: the overlap checker TorchRec's sharded version would use.
    """

    def __init__(self, embedding_collection: EmbeddingCollection,
                 checker_type: OverlappingCheckerType = OverlappingCheckerType.BOOLEAN) -> None:
        super().__init__()
        if not isinstance(checker_type, OverlappingCheckerType):
            raise TypeError(f"checker_type must be an OverlappingCheckerType, got {checker_type!r}")
        self._embedding_collection = embedding_collection
        self._checker_type = checker_type

    @property
    def embedding_collection(self) -> EmbeddingCollection:
        return self._embedding_collection

    @property
    def checker_type(self) -> OverlappingCheckerType:
        return self._checker_type

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """KJT -> {feature: JaggedTensor of [N_f, D] rows}: the collection's output."""
        return self._embedding_collection(features)

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._embedding_collection.embedding_configs()

    def embedding_dim(self) -> int:
        return self._embedding_collection.embedding_dim()

    def need_indices(self) -> bool:
        return self._embedding_collection.need_indices()


class _ITEPWrapper(nn.Module):
    """An iteration counter (``_iter``, an int64 scalar kept on the CPU and in the state_dict) and the pruning step."""

    _iter: torch.Tensor

    def __init__(self, name: str, collection: nn.Module, itep_module: nn.Module) -> None:
        super().__init__()
        setattr(self, name, collection)  # registered first, as TorchRec's: its state_dict keys come in the same order
        if not callable(itep_module):
            raise TypeError(f"itep_module must be callable as itep_module(features, iteration), got {itep_module!r}")
        self._itep_module = itep_module
        self.register_buffer("_iter", torch.tensor(0, dtype=torch.int64, device=torch.device("cpu")))

    def _pruned(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        self._iter = self._iter.cpu()  # read every step: kept on the CPU even after .to(cuda)
        return self._itep_module(features, int(self._iter.item()))


class ITEPEmbeddingBagCollection(_ITEPWrapper):
    """An EmbeddingBagCollection whose features first go through ``itep_module(features, iteration)``.

    Args:
        embedding_bag_collection: the tables.
        itep_module: maps (KJT, the iteration count from 0) to the KJT to look up (e.g. ids remapped to the rows
            that survived pruning).

    forward(features) -> KeyedTensor [B, sum of dims], as the collection's; the iteration count then grows by one.
    """

    _embedding_bag_collection: EmbeddingBagCollection

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, itep_module: nn.Module) -> None:
        super().__init__("_embedding_bag_collection", embedding_bag_collection, itep_module)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        pooled = self._embedding_bag_collection(self._pruned(features))
        self._iter += 1
        return pooled

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._embedding_bag_collection.embedding_bag_configs()


class ITEPEmbeddingCollection(_ITEPWrapper):
    """An EmbeddingCollection whose features first go through ``itep_module(features, iteration)``; see
    ITEPEmbeddingBagCollection. forward(features) -> {feature: JaggedTensor of [N_f, D] rows}."""

    _embedding_collection: EmbeddingCollection

    def __init__(self, embedding_collection: EmbeddingCollection, itep_module: nn.Module) -> None:
        super().__init__("_embedding_collection", embedding_collection, itep_module)

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        embeddings = self._embedding_collection(self._pruned(features))
        self._iter += 1
        return embeddings

    def embedding_bag_configs(self) -> List[EmbeddingConfig]:
        """The collection's EmbeddingConfigs (TorchRec's name for them here)."""
        return self._embedding_collection.embedding_configs()


__all__ = ["DebugEmbeddingBagCollection", "DebugEmbeddingCollection", "ITEPEmbeddingBagCollection", "ITEPEmbeddingCollection",
           "OverlappingCheckerType", "PECEmbeddingCollection"]
