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

from typing import Callable, List, Type

from torch import nn

from recship.quantize.feature_processed import QuantFeatureProcessedEmbeddingBagCollection
from recship.quantize.feature_processed import QuantFeatureProcessedEmbeddingBagCollection as FeatureProcessedEmbeddingBagCollection
from recship.quantize.modules import PRUNING_ATTR, REGISTER_TBES_ATTR, ROW_ALIGNMENT_ATTR, SPLIT_SCALE_BIAS_ATTR, TORCHREC_ROW_ALIGNMENT
from recship.quantize.modules import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from recship.quantize.modules import QuantEmbeddingBagCollection as EmbeddingBagCollection
from recship.quantize.modules import QuantEmbeddingCollection as EmbeddingCollection
from recship.quantize.quantizer import QuantConfig
from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.trainer.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig
from recship.trainer.embedding_modules import EmbeddingBagCollection as OriginalEmbeddingBagCollection
from recship.trainer.embedding_modules import EmbeddingCollection as OriginalEmbeddingCollection
from recship.trainer.feature_processors import FeatureProcessedEmbeddingBagCollection as OriginalFeatureProcessedEmbeddingBagCollection
from recship.trainer.feature_processors import FeatureProcessorsCollection
from recship.trainer.types import DataType, PoolingType

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
           "PoolingType", "QuantConfig", "QuantEmbeddingBagCollection", "QuantEmbeddingCollection",
           "QuantFeatureProcessedEmbeddingBagCollection", "for_each_module_of_type_do", "quant_prep_customize_row_alignment",
           "quant_prep_enable_cache_features_order", "quant_prep_enable_quant_state_dict_split_scale_bias",
           "quant_prep_enable_quant_state_dict_split_scale_bias_for_types", "quant_prep_enable_register_tbes"]
