"""QuantFeatureProcessedEmbeddingBagCollection: TorchRec's quantized FP-EBC (``torchrec.quant.embedding_modules.
FeatureProcessedEmbeddingBagCollection``): a QuantEmbeddingBagCollection whose per-id weights come from the float
feature processors it runs first.

    fp_ebc.qconfig = QuantConfig(activation=PlaceholderObserver.with_args(dtype=torch.float),
                                 weight=PlaceholderObserver.with_args(dtype=torch.qint8))
    qfp = QuantFeatureProcessedEmbeddingBagCollection.from_float(fp_ebc)
    qfp(kjt)   # KeyedTensor [B, sum of dims]: fp_ebc's pooled output with int8 rows

The state_dict is TorchRec's: ``embedding_bags.<table>.weight`` (the quantized rows) and
``feature_processor.<processor's keys>`` (float position weights). The rows answer exactly what the plain
QuantEmbeddingBagCollection of the same tables answers; the processors are the float module's own (not copied).
"""

from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from recship.quantize.modules import (PRUNING_ATTR, REGISTER_TBES_ATTR, SPLIT_SCALE_BIAS_ATTR, TORCHREC_ROW_ALIGNMENT,
                                      QuantEmbeddingBagCollection, quantize_from_float)
from recship.sparse import KeyedJaggedTensor, KeyedTensor
from recship.modules.embedding_configs import EmbeddingBagConfig
from recship.trainer.feature_processors import FeatureProcessedEmbeddingBagCollection, FeatureProcessorsCollection


class QuantFeatureProcessedEmbeddingBagCollection(QuantEmbeddingBagCollection):
    """Feature processors (float) then quantized pooled lookups: KJT [F, B] in, KeyedTensor [B, sum of dims] out.

    TorchRec's constructor: ``tables`` carry each table's stored type in ``data_type`` (INT8, INT4, FP16, ...);
    ``table_name_to_quantized_weights`` gives table -> (packed rows [rows, data bytes] uint8, scale/bias
    [rows, 4] uint8 or None), as TorchRec's ``quantize_state_dict`` makes them (None: rows zero, to be loaded);
    ``register_tbes`` / ``quant_state_dict_split_scale_bias`` choose the state_dict layout (see
    ``QuantTables.set_state_dict_layout``). ``feature_processor`` is required (TorchRec asserts; here ValueError).
    The outputs are in ``output_dtype`` (float32 by default; as QuantEmbeddingBagCollection's); ``cache_features_order`` is accepted and
    changes nothing (recship looks features up by name).
    """

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool,
        device: Union[str, torch.device],
        output_dtype: torch.dtype = torch.float,
        table_name_to_quantized_weights: Optional[Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]] = None,
        register_tbes: bool = False,
        quant_state_dict_split_scale_bias: bool = False,
        row_alignment: int = TORCHREC_ROW_ALIGNMENT,
        feature_processor: Optional[FeatureProcessorsCollection] = None,
        cache_features_order: bool = False,
        *,
        id_policy: Optional[Dict[str, str]] = None,
    ) -> None:
        if feature_processor is None:
            raise ValueError("QuantFeatureProcessedEmbeddingBagCollection needs a feature_processor "
                             "(without one, use QuantEmbeddingBagCollection)")
        super().__init__(tables, is_weighted, device, output_dtype, table_name_to_quantized_weights, register_tbes,
                         quant_state_dict_split_scale_bias, row_alignment, cache_features_order, id_policy=id_policy)
        self.feature_processor = feature_processor

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return super().forward(self.feature_processor(features))

    def _get_name(self) -> str:
        return "QuantFeatureProcessedEmbeddingBagCollection"

    @classmethod
    def from_float(cls, module: nn.Module,  # type: ignore[override]
                   use_precomputed_fake_quant: bool = False) -> "QuantFeatureProcessedEmbeddingBagCollection":
        """The quantized twin of a float FeatureProcessedEmbeddingBagCollection that carries a ``qconfig``
        (a QuantConfig, or torch's QConfig): its tables quantized as ``QuantEmbeddingBagCollection.from_float``
        quantizes the inner collection, its feature processors kept as they are (float, shared)."""
        if not isinstance(module, FeatureProcessedEmbeddingBagCollection):
            raise TypeError(f"{cls.__name__}.from_float takes a float FeatureProcessedEmbeddingBagCollection, "
                            f"got {type(module).__name__}")
        if not hasattr(module, "qconfig"):
            raise ValueError("FeatureProcessedEmbeddingBagCollection.from_float: the module has no qconfig")
        processors, ebc = module.split()
        # the inner collection is quantized under the FP-EBC's qconfig and quant_prep marks (TorchRec reads the
        # register-TBEs mark from the FP-EBC, the split and alignment marks from the inner collection)
        saved = {attr: getattr(ebc, attr) for attr in ("qconfig", PRUNING_ATTR, REGISTER_TBES_ATTR) if hasattr(ebc, attr)}
        try:
            ebc.qconfig = module.qconfig
            for attr in (PRUNING_ATTR, REGISTER_TBES_ATTR):
                if hasattr(module, attr):
                    setattr(ebc, attr, getattr(module, attr))
            quantized = quantize_from_float(QuantEmbeddingBagCollection, ebc)
        finally:
            for attr in ("qconfig", PRUNING_ATTR, REGISTER_TBES_ATTR):
                if attr in saved:
                    setattr(ebc, attr, saved[attr])
                elif hasattr(ebc, attr):
                    delattr(ebc, attr)
        device = next(iter(quantized.table_weights().values()))[0].device
        out = cls(quantized.embedding_bag_configs(), ebc.is_weighted(), device=device, output_dtype=quantized.output_dtype(),
                  row_alignment=quantized.row_alignment, feature_processor=processors,
                  register_tbes=bool(getattr(module, REGISTER_TBES_ATTR, False)),
                  quant_state_dict_split_scale_bias=bool(getattr(ebc, SPLIT_SCALE_BIAS_ATTR, False)), id_policy=quantized.id_policy)
        copy_rows(quantized, out)
        return out


def copy_rows(source: QuantEmbeddingBagCollection, target: QuantEmbeddingBagCollection) -> None:
    """``target``'s stored rows (and scale/bias) := ``source``'s, table by table (same tables, types, alignment)."""
    given = source.table_weights()
    for name, (data, scale_bias) in target.table_weights().items():
        data.copy_(given[name][0])
        if scale_bias is not None:
            src = given[name][1]
            assert src is not None  # the same type, so the same scale/bias layout
            scale_bias.copy_(src)



class FeatureProcessedLookup(nn.Module):
    """A QuantFeatureProcessedEmbeddingBagCollection once its tables are sharded (TorchRec's
    ShardedQuantFeatureProcessedEmbeddingBagCollection) or flattened for export: the float feature processors,
    then ``lookup`` (KJT in, KeyedTensor [B, sum of dims] out) on the weighted features they give."""

    def __init__(self, feature_processor: nn.Module, lookup: nn.Module) -> None:
        super().__init__()
        self.feature_processor = feature_processor
        self.lookup = lookup

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return self.lookup(self.feature_processor(features))


__all__ = ["FeatureProcessedLookup", "QuantFeatureProcessedEmbeddingBagCollection", "copy_rows"]
