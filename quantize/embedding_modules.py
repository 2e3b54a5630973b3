"""TorchRec's names for recship's quantized collections (``torchrec.quant.embedding_modules``).

TorchRec calls its quantized modules ``EmbeddingBagCollection`` and ``EmbeddingCollection``,
the same names as the float ones, telling them apart by module; its tutorials import
``from torchrec.quant.embedding_modules import EmbeddingBagCollection as
QuantEmbeddingBagCollection``. This module gives that import path the same meaning in
recship: the names below ARE ``recship.quantize.QuantEmbeddingBagCollection`` and
``QuantEmbeddingCollection`` (the same classes, not subclasses), so

    quantize_dynamic(model, qconfig_spec={recship.EmbeddingBagCollection: qconfig},
                     mapping={recship.EmbeddingBagCollection: EmbeddingBagCollection})

swaps every float collection for recship's quantized one (``from_float``). Elsewhere
recship uses the unambiguous ``Quant...`` names. ``FeatureProcessedEmbeddingBagCollection`` here is
the quantized FP-EBC (``recship.quantize.feature_processed.QuantFeatureProcessedEmbeddingBagCollection``;
the float one is ``OriginalFeatureProcessedEmbeddingBagCollection``, as in TorchRec); a quantize_dynamic
with only the EBC mapping swaps an FP-EBC's inner collection and keeps its processors, as TorchRec's does.

TorchRec's ``quant_prep_*`` functions mark float collections before ``from_float`` so that the
quantized state_dict splits scale and bias out of the rows (``weight`` / ``weight_qscale`` /
``weight_qbias``) or includes the TBEs' buffers; by default it holds ``<table>.weight`` only.
"""

from typing import Callable, Dict, List, Optional, Tuple, Type

import torch
from torch import nn

from recship.quantize.feature_processed import QuantFeatureProcessedEmbeddingBagCollection
from recship.quantize.managed_collisions import QuantManagedCollisionEmbeddingBagCollection, QuantManagedCollisionEmbeddingCollection
from recship.quantize.feature_processed import QuantFeatureProcessedEmbeddingBagCollection as FeatureProcessedEmbeddingBagCollection
from recship.quantize.modules import PRUNING_ATTR, REGISTER_TBES_ATTR, ROW_ALIGNMENT_ATTR, SPLIT_SCALE_BIAS_ATTR, TORCHREC_ROW_ALIGNMENT
from recship.quantize.modules import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from recship.quantize.modules import QuantEmbeddingBagCollection as EmbeddingBagCollection
from recship.quantize.modules import QuantEmbeddingCollection as EmbeddingCollection
from recship.quantize.quantizer import QuantConfig
from recship.quantize.rowwise import quantize_rows, row_bytes
from recship.quantize.sharded import ShardedQuantEmbeddingBagCollection
from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig
from recship.modules.embedding_modules import EmbeddingBagCollection as OriginalEmbeddingBagCollection
from recship.modules.embedding_modules import EmbeddingCollection as OriginalEmbeddingCollection
from recship.trainer.feature_processors import FeatureProcessedEmbeddingBagCollection as OriginalFeatureProcessedEmbeddingBagCollection
from recship.trainer.feature_processors import FeatureProcessorsCollection
from recship.trainer.managed_collisions import ManagedCollisionEmbeddingBagCollection as OriginalManagedCollisionEmbeddingBagCollection
from recship.trainer.managed_collisions import ManagedCollisionEmbeddingCollection as OriginalManagedCollisionEmbeddingCollection
from recship.modules.types import DataType, PoolingType

# TorchRec's module attributes that its quant_prep_* functions set on float collections before from_float
MODULE_ATTR_QUANT_STATE_DICT_SPLIT_SCALE_BIAS = SPLIT_SCALE_BIAS_ATTR
MODULE_ATTR_REGISTER_TBES_BOOL = REGISTER_TBES_ATTR
MODULE_ATTR_ROW_ALIGNMENT_INT = ROW_ALIGNMENT_ATTR
MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT = PRUNING_ATTR
# read by TorchRec's kernels for speed, by nothing in recship (features are looked up by name; no STBE padding;
# outputs are plain KeyedTensors): set, they change nothing
MODULE_ATTR_CACHE_FEATURES_ORDER = "__cache_features_order"
MODULE_ATTR_REMOVE_STBE_PADDING_BOOL = "__remove_stbe_padding"
MODULE_ATTR_USE_UNFLATTENED_LENGTHS_FOR_BATCHING = "__use_unflattened_lengths_for_batching"
MODULE_ATTR_USE_BATCHING_HINTED_OUTPUT = "__use_batching_hinted_output"
DEFAULT_ROW_ALIGNMENT = TORCHREC_ROW_ALIGNMENT


def for_each_module_of_type_do(module: nn.Module, module_types: List[Type[nn.Module]], op: Callable[[nn.Module], None]) -> None:
    """``op(m)`` for every submodule ``m`` of ``module`` (itself included) that is one of ``module_types``."""
    for m in module.modules():
        if isinstance(m, tuple(module_types)):
            op(m)


def quant_prep_customize_row_alignment(module: nn.Module, module_types: List[Type[nn.Module]], row_alignment: int) -> None:
    """Every ``module_types`` submodule of ``module`` quantizes with rows padded to ``row_alignment`` bytes (default 16)."""
    if isinstance(row_alignment, bool) or not isinstance(row_alignment, int) or row_alignment < 1:
        raise ValueError(f"row_alignment must be a positive int, got {row_alignment!r}")
    for_each_module_of_type_do(module, module_types, lambda m: setattr(m, ROW_ALIGNMENT_ATTR, row_alignment))


def quantize_state_dict(module: nn.Module, table_name_to_quantized_weights: Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]],
                        table_name_to_data_type: Dict[str, DataType],
                        table_name_to_num_embeddings_post_pruning: Optional[Dict[str, int]] = None) -> torch.device:
    """Quantizes every ``<...>.<table>.weight`` of ``module``'s state_dict (a float collection's) into
    ``table_name_to_quantized_weights[table]`` = (packed rows [rows, data bytes] uint8, scale/bias [rows, 4] uint8 or
    None), what the quantized constructors' ``table_name_to_quantized_weights`` takes; returns the weights' device.
    INT8/INT4/INT2 rows are min/max row-wise (fbgemm's FloatToFusedNBitRowwiseQuantizedSBHalf bytes), FP16/FP32 the
    values, FP8 fbgemm's hfp8; a table in ``table_name_to_num_embeddings_post_pruning`` keeps its first rows. Rows on
    ``meta`` give empty meta tensors of the right shapes. ValueError for a key that is not a table weight."""
    device = torch.device("cpu")
    pruned = table_name_to_num_embeddings_post_pruning or {}
    for key, tensor in module.state_dict().items():
        parts = key.split(".")
        if parts[-1] != "weight" or len(parts) < 2:
            raise ValueError(f"quantize_state_dict: {key!r} is not a table's weight (<...>.<table>.weight)")
        table = parts[-2]
        data_type = table_name_to_data_type[table]
        rows = pruned.get(table, tensor.shape[0])
        device = tensor.device
        if tensor.is_meta:
            width = row_bytes(data_type, tensor.shape[1]) - (4 if data_type in (DataType.INT8, DataType.INT4, DataType.INT2) else 0)
            scale_bias = (torch.empty((rows, 4), device="meta", dtype=torch.uint8)
                          if data_type in (DataType.INT8, DataType.INT4, DataType.INT2) else None)
            table_name_to_quantized_weights[table] = (torch.empty((rows, width), device="meta", dtype=torch.uint8), scale_bias)
            continue
        if tensor.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"quantize_state_dict: table {table!r} is {tensor.dtype}; float32 or float16 rows are quantized")
        quantized = quantize_rows(tensor[:rows], data_type)
        table_name_to_quantized_weights[table] = (quantized.data, quantized.scale_bias)
    return device


def populate_fx_names(quant_ebc: nn.Module) -> None:
    """TorchRec's fx names (``_fx_path``) on the TBEs of a (sharded) QuantEmbeddingBagCollection: "emb_module.<its
    tables>" for each TBE of a collection, "embedding_lookup.sharding_<k>.group_<g>.tbe" for each TBE of shard k.
    recship's Tracer finds the TBEs by their module paths; the names are for code that reads them."""
    if isinstance(quant_ebc, QuantEmbeddingBagCollection):
        for tbe, tables in zip(quant_ebc.tbes, quant_ebc._kernel_tables()):
            setattr(tbe, "_fx_path", "emb_module." + ",".join(tables))
    elif isinstance(quant_ebc, ShardedQuantEmbeddingBagCollection):
        for k, shard in enumerate(quant_ebc.shards):
            setattr(shard, "_fx_path", f"embedding_lookup.sharding_{k}")
            for g, tbe in enumerate(getattr(shard, "tbes")):
                setattr(tbe, "_fx_path", f"embedding_lookup.sharding_{k}.group_{g}.tbe")


def recursive_populate_fx_names(module: nn.Module) -> None:
    """``populate_fx_names`` on every (sharded) QuantEmbeddingBagCollection in ``module``."""
    if isinstance(module, (QuantEmbeddingBagCollection, ShardedQuantEmbeddingBagCollection)):
        populate_fx_names(module)
        return
    for child in module.children():
        recursive_populate_fx_names(child)


def meta_to_cpu_placement(module: nn.Module) -> None:
    """TorchRec rebuilds quantized collections left on ``meta`` on the CPU. recship's never are (a collection on
    meta quantizes to zero rows on the CPU, to be loaded), so this checks that: ValueError names one whose rows are."""
    for path, m in module.named_modules():
        if isinstance(m, (QuantEmbeddingBagCollection, QuantEmbeddingCollection)):
            on_meta = [name for name, (data, _) in m.table_weights().items() if data.is_meta]
            if on_meta:
                raise ValueError(f"{path or 'the module'}: tables {on_meta} are on meta")


def quant_prep_enable_cache_features_order(module: nn.Module, module_types: List[Type[nn.Module]]) -> None:
    """TorchRec's mark for its kernels to cache the features' order; recship looks features up by name, so the mark
    changes nothing (it is set, as TorchRec sets it)."""
    for_each_module_of_type_do(module, module_types, lambda m: setattr(m, MODULE_ATTR_CACHE_FEATURES_ORDER, True))


def quant_prep_enable_quant_state_dict_split_scale_bias(module: nn.Module) -> None:
    """``module`` (a float collection) quantizes to a state_dict with scale and bias apart from the rows."""
    setattr(module, SPLIT_SCALE_BIAS_ATTR, True)


def quant_prep_enable_quant_state_dict_split_scale_bias_for_types(module: nn.Module, module_types: List[Type[nn.Module]]) -> None:
    """The same for every submodule of ``module`` (itself included) that is one of ``module_types``."""
    for m in module.modules():
        if isinstance(m, tuple(module_types)):
            setattr(m, SPLIT_SCALE_BIAS_ATTR, True)


def quant_prep_enable_register_tbes(module: nn.Module, module_types: List[Type[nn.Module]]) -> None:
    """Every ``module_types`` submodule of ``module`` quantizes to a state_dict that includes its TBEs' buffers."""
    for m in module.modules():
        if isinstance(m, tuple(module_types)):
            setattr(m, REGISTER_TBES_ATTR, True)


__all__ = ["BaseEmbeddingConfig", "DEFAULT_ROW_ALIGNMENT", "DataType", "EmbeddingBagCollection", "EmbeddingBagConfig",
           "EmbeddingCollection", "EmbeddingConfig", "FeatureProcessedEmbeddingBagCollection", "FeatureProcessorsCollection",
           "JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "MODULE_ATTR_CACHE_FEATURES_ORDER",
           "MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT", "MODULE_ATTR_QUANT_STATE_DICT_SPLIT_SCALE_BIAS",
           "MODULE_ATTR_REGISTER_TBES_BOOL", "MODULE_ATTR_REMOVE_STBE_PADDING_BOOL", "MODULE_ATTR_ROW_ALIGNMENT_INT",
           "MODULE_ATTR_USE_BATCHING_HINTED_OUTPUT", "MODULE_ATTR_USE_UNFLATTENED_LENGTHS_FOR_BATCHING",
           "OriginalEmbeddingBagCollection", "OriginalEmbeddingCollection", "OriginalFeatureProcessedEmbeddingBagCollection",
           "OriginalManagedCollisionEmbeddingBagCollection", "OriginalManagedCollisionEmbeddingCollection",
           "PoolingType", "QuantConfig", "QuantEmbeddingBagCollection", "QuantEmbeddingCollection",
           "QuantManagedCollisionEmbeddingBagCollection", "QuantManagedCollisionEmbeddingCollection",
           "QuantFeatureProcessedEmbeddingBagCollection", "for_each_module_of_type_do", "quant_prep_customize_row_alignment",
           "quant_prep_enable_cache_features_order", "quant_prep_enable_quant_state_dict_split_scale_bias",
           "quant_prep_enable_quant_state_dict_split_scale_bias_for_types", "quant_prep_enable_register_tbes", "quantize_state_dict",
           "ShardedQuantEmbeddingBagCollection", "meta_to_cpu_placement", "populate_fx_names", "recursive_populate_fx_names"]
