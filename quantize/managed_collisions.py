"""Quantized managed-collision collections (TorchRec's ``torchrec.quant.embedding_modules.
QuantManagedCollisionEmbeddingCollection`` / ``QuantManagedCollisionEmbeddingBagCollection``): the trained
ManagedCollisionCollection remaps the raw ids, then quantized rows are looked up.

    mc_ebc.qconfig = QuantConfig(activation=PlaceholderObserver.with_args(dtype=torch.float),
                                 weight=PlaceholderObserver.with_args(dtype=torch.qint8))
    qmc = QuantManagedCollisionEmbeddingBagCollection.from_float(mc_ebc.eval())
    pooled, remapped = qmc(kjt)   # KeyedTensor [B, sum of dims] (int8 rows); the KJT of rows looked up

or, for a whole model, torch's ``quantize_dynamic`` with ``mapping={ManagedCollisionEmbeddingCollection:
QuantManagedCollisionEmbeddingCollection, ...}`` (TorchRec's way; ``recship.inference.quantize_embeddings`` takes
it as ``additional_mapping``). The managed-collision collection is the float module's own (shared, not copied, as in
TorchRec), so its slots (``_mch_sorted_raw_ids`` / ``_mch_remapped_ids_mapping``) are the trained ones. It remaps
as it is: in training mode it still profiles and evicts, so call ``eval()`` before serving, as with TorchRec.

State-dict keys are TorchRec's: ``embeddings.<table>.weight`` (``embedding_bags.`` for the bag collection) and
``_managed_collision_collection._managed_collision_modules.<table>.<buffer>``. ``forward`` returns the remapped
KeyedJaggedTensor whatever ``return_remapped_features`` says, as TorchRec 1.8.0 does.

Differences from TorchRec: ``from_float`` of a collection whose inner EmbeddingCollection is still float
quantizes its rows (TorchRec builds randomly initialised rows then: it only carries the rows over when the inner
collection was quantized first); the configs are compared by table, rows, dim and features, not by their text
(so the float collection's configs are not rewritten to the quantized ``data_type``, as TorchRec rewrites them).
"""

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from recship.quantize.modules import (PRUNING_ATTR, REGISTER_TBES_ATTR, SPLIT_SCALE_BIAS_ATTR,
                                      TORCHREC_ROW_ALIGNMENT, QuantEmbeddingBagCollection, QuantEmbeddingCollection,
                                      quantize_from_float)
from recship.quantize.tbe import QuantTables
from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.managed_collisions.embedding import (BaseManagedCollisionEmbeddingCollection, ManagedCollisionEmbeddingBagCollection,
                                                          ManagedCollisionEmbeddingCollection)
from recship.trainer.managed_collisions.modules import ManagedCollisionCollection

StoredRows = Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]


def _check_collection(kind: str, tables: Sequence[BaseEmbeddingConfig], mcc: Optional[ManagedCollisionCollection]) -> ManagedCollisionCollection:
    """``mcc``, checked to be a ManagedCollisionCollection over the same tables (name, rows, dim, features)."""
    if mcc is None:
        raise ValueError(f"{kind} needs a managed_collision_collection (without one, use the plain quantized collection)")
    if not isinstance(mcc, ManagedCollisionCollection):
        raise TypeError(f"{kind}: managed_collision_collection must be a ManagedCollisionCollection, got {type(mcc).__name__}")

    def shape(configs: Sequence[BaseEmbeddingConfig]) -> List[Tuple[str, int, int, List[str]]]:
        return [(c.name, c.num_embeddings, c.embedding_dim, list(c.feature_names)) for c in configs]

    if shape(tables) != shape(mcc.embedding_configs()):
        raise ValueError(f"{kind}: the tables {shape(tables)} and the ManagedCollisionCollection's "
                         f"{shape(mcc.embedding_configs())} must be the same (name, rows, dim, features)")
    for m in mcc._managed_collision_modules.values():  # a quantized collection serves: no eviction pending
        reset = getattr(m, "reset_inference_mode", None)
        if callable(reset):
            reset()
    return mcc


class QuantManagedCollisionEmbeddingCollection(QuantEmbeddingCollection):
    """Managed collisions, then quantized unpooled lookups: KJT of raw ids in, ({feature: JaggedTensor of [n, dim]
    rows in ``output_dtype``}, the remapped KJT) out.

    TorchRec's constructor: the arguments of QuantEmbeddingCollection (``tables`` with their stored ``data_type``,
    ``table_name_to_quantized_weights`` from ``quantize_state_dict`` or None for zero rows to be loaded, ...), and
    ``managed_collision_collection`` (required: ValueError without one) over the same tables.
    """

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        device: Union[str, torch.device],
        need_indices: bool = False,
        output_dtype: torch.dtype = torch.float,
        table_name_to_quantized_weights: Optional[StoredRows] = None,
        register_tbes: bool = False,
        quant_state_dict_split_scale_bias: bool = False,
        row_alignment: int = TORCHREC_ROW_ALIGNMENT,
        managed_collision_collection: Optional[ManagedCollisionCollection] = None,
        return_remapped_features: bool = False,
        cache_features_order: bool = False,
        *,
        id_policy: Optional[Dict[str, str]] = None,
    ) -> None:
        mcc = _check_collection(type(self).__name__, tables, managed_collision_collection)
        super().__init__(tables, device, need_indices, output_dtype, table_name_to_quantized_weights, register_tbes,
                         quant_state_dict_split_scale_bias, row_alignment, cache_features_order, id_policy=id_policy)
        self._managed_collision_collection = mcc
        self._return_remapped_features = return_remapped_features

    def forward(self, features: KeyedJaggedTensor) -> Tuple[Dict[str, JaggedTensor], KeyedJaggedTensor]:  # type: ignore[override]
        """features: KJT [F x B x L] of raw int64 ids -> (each feature's rows of its remapped ids, the remapped KJT)."""
        remapped = self._managed_collision_collection(features)
        return super().forward(remapped), remapped

    def _get_name(self) -> str:
        return "QuantManagedCollisionEmbeddingCollection"

    @classmethod
    def from_float(cls, module: nn.Module,  # type: ignore[override]
                   return_remapped_features: bool = False) -> "QuantManagedCollisionEmbeddingCollection":
        """The quantized twin of a ManagedCollisionEmbeddingCollection carrying a ``qconfig`` (what torch's
        ``quantize_dynamic`` calls): its collection's rows quantized under that qconfig (or, when ``quantize_dynamic``
        swapped the inner collection first, its quantized rows as they are), its managed-collision collection shared.
        ``return_remapped_features`` is TorchRec's unused argument: the float module's setting is kept."""
        if not isinstance(module, ManagedCollisionEmbeddingCollection):
            raise TypeError(f"{cls.__name__}.from_float takes a ManagedCollisionEmbeddingCollection, got {type(module).__name__}")
        inner = _quantized_inner(module, EmbeddingCollection, QuantEmbeddingCollection)
        assert isinstance(inner, QuantEmbeddingCollection)  # _quantized_inner builds or checks it
        return cls(inner.embedding_configs(), inner.device, need_indices=inner.need_indices(), output_dtype=inner.output_dtype(),
                   table_name_to_quantized_weights=inner.table_weights(), row_alignment=inner.row_alignment,
                   managed_collision_collection=module._managed_collision_collection,
                   return_remapped_features=module._return_remapped_features, id_policy=inner.id_policy,
                   **_layout_flags(module))


class QuantManagedCollisionEmbeddingBagCollection(QuantEmbeddingBagCollection):
    """Managed collisions, then quantized pooled lookups: KJT of raw ids in, (KeyedTensor [B, sum of dims] in ``output_dtype``,
    the remapped KJT) out.

    TorchRec's constructor: the arguments of QuantEmbeddingBagCollection and ``managed_collision_collection``
    (required: ValueError without one) over the same tables.
    """

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool,
        device: Union[str, torch.device],
        output_dtype: torch.dtype = torch.float,
        table_name_to_quantized_weights: Optional[StoredRows] = None,
        register_tbes: bool = False,
        quant_state_dict_split_scale_bias: bool = False,
        row_alignment: int = TORCHREC_ROW_ALIGNMENT,
        managed_collision_collection: Optional[ManagedCollisionCollection] = None,
        return_remapped_features: bool = False,
        cache_features_order: bool = False,
        *,
        id_policy: Optional[Dict[str, str]] = None,
    ) -> None:
        mcc = _check_collection(type(self).__name__, tables, managed_collision_collection)
        super().__init__(tables, is_weighted, device, output_dtype, table_name_to_quantized_weights, register_tbes,
                         quant_state_dict_split_scale_bias, row_alignment, cache_features_order, id_policy=id_policy)
        self._managed_collision_collection = mcc
        self._return_remapped_features = return_remapped_features

    def forward(self, features: KeyedJaggedTensor) -> Tuple[KeyedTensor, KeyedJaggedTensor]:  # type: ignore[override]
        """features: KJT [F x B x L] of raw int64 ids -> (KeyedTensor [B, sum of dims] pooled over the remapped ids,
        the remapped KJT)."""
        remapped = self._managed_collision_collection(features)
        return super().forward(remapped), remapped

    def _get_name(self) -> str:
        return "QuantManagedCollisionEmbeddingBagCollection"

    @classmethod
    def from_float(cls, module: nn.Module,  # type: ignore[override]
                   return_remapped_features: bool = False) -> "QuantManagedCollisionEmbeddingBagCollection":
        """The quantized twin of a ManagedCollisionEmbeddingBagCollection carrying a ``qconfig``; see
        ``QuantManagedCollisionEmbeddingCollection.from_float``."""
        if not isinstance(module, ManagedCollisionEmbeddingBagCollection):
            raise TypeError(f"{cls.__name__}.from_float takes a ManagedCollisionEmbeddingBagCollection, got {type(module).__name__}")
        inner = _quantized_inner(module, EmbeddingBagCollection, QuantEmbeddingBagCollection)
        assert isinstance(inner, QuantEmbeddingBagCollection)  # _quantized_inner builds or checks it
        return cls(inner.embedding_bag_configs(), inner.is_weighted(), inner.device, output_dtype=inner.output_dtype(),
                   table_name_to_quantized_weights=inner.table_weights(), row_alignment=inner.row_alignment,
                   managed_collision_collection=module._managed_collision_collection,
                   return_remapped_features=module._return_remapped_features, id_policy=inner.id_policy,
                   **_layout_flags(module))


QuantManagedCollision = Union[QuantManagedCollisionEmbeddingCollection, QuantManagedCollisionEmbeddingBagCollection]


def _quantized_inner(module: BaseManagedCollisionEmbeddingCollection, float_type: type, quant_type: type) -> QuantTables:
    """``module._embedding_module`` quantized: as it is when ``quantize_dynamic`` already swapped it (a plain
    ``quant_type``), else quantized under ``module``'s qconfig and quant_prep marks (TorchRec reads the register-TBEs
    mark from the managed-collision module, the split and alignment marks from the inner collection)."""
    inner: nn.Module = module._embedding_module
    if isinstance(inner, QuantTables) and type(inner) is quant_type:
        return inner
    if type(inner) is not float_type:
        raise TypeError(f"{type(module).__name__}._embedding_module must be a {float_type.__name__} (or its quantized twin), "
                        f"got {type(inner).__name__}")
    if not hasattr(module, "qconfig"):
        raise ValueError(f"{type(module).__name__}.from_float: the module has no qconfig (quantize_dynamic sets it)")
    moved = ("qconfig", PRUNING_ATTR, REGISTER_TBES_ATTR)
    saved = {attr: getattr(inner, attr) for attr in moved if hasattr(inner, attr)}
    try:
        inner.qconfig = module.qconfig
        for attr in (PRUNING_ATTR, REGISTER_TBES_ATTR):
            if hasattr(module, attr):
                setattr(inner, attr, getattr(module, attr))
        return quantize_from_float(quant_type, inner)
    finally:
        for attr in moved:
            if attr in saved:
                setattr(inner, attr, saved[attr])
            elif hasattr(inner, attr):
                delattr(inner, attr)


def _layout_flags(module: BaseManagedCollisionEmbeddingCollection) -> Dict[str, bool]:
    """The state_dict layout TorchRec's quant_prep_* marks ask for: register-TBEs on the managed-collision module,
    split scale/bias on its inner collection (or on the module)."""
    inner = module._embedding_module
    split = bool(getattr(inner, SPLIT_SCALE_BIAS_ATTR, False) or getattr(module, SPLIT_SCALE_BIAS_ATTR, False))
    return {"register_tbes": bool(getattr(module, REGISTER_TBES_ATTR, False)), "quant_state_dict_split_scale_bias": split}


class ManagedCollisionLookup(nn.Module):
    """A QuantManagedCollisionEmbeddingBagCollection once its tables are sharded for inference (one process, several
    devices): its managed-collision collection (whole: this process sees every id, so it remaps exactly as unsharded)
    in front of ``lookup`` (KJT of rows in, KeyedTensor [B, sum of dims] out). Returns (pooled, remapped KJT) as
    the unsharded module does."""

    def __init__(self, managed_collision_collection: ManagedCollisionCollection, lookup: nn.Module,
                 return_remapped_features: bool = False) -> None:
        super().__init__()
        self._managed_collision_collection = managed_collision_collection
        self.lookup = lookup
        self._return_remapped_features = return_remapped_features

    def forward(self, features: KeyedJaggedTensor) -> Tuple[KeyedTensor, KeyedJaggedTensor]:
        remapped = self._managed_collision_collection(features)
        return self.lookup(remapped), remapped


__all__ = ["ManagedCollisionLookup", "QuantManagedCollisionEmbeddingBagCollection", "QuantManagedCollisionEmbeddingCollection"]
