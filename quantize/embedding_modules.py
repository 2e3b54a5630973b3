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
recship uses the unambiguous ``Quant...`` names. A FeatureProcessedEmbeddingBagCollection
(``OriginalFeatureProcessedEmbeddingBagCollection`` here, as in TorchRec) keeps its feature
processors and gets its inner collection swapped (recship has no quantized FP-EBC class).

TorchRec's ``quant_prep_*`` functions mark float collections before ``from_float`` so that the
quantized state_dict splits scale and bias out of the rows (``weight`` / ``weight_qscale`` /
``weight_qbias``) or includes the TBEs' buffers; by default it holds ``<table>.weight`` only.
"""

from typing import List, Type

from torch import nn

from recship.quantize.modules import REGISTER_TBES_ATTR, SPLIT_SCALE_BIAS_ATTR
from recship.quantize.modules import QuantEmbeddingBagCollection as EmbeddingBagCollection
from recship.quantize.modules import QuantEmbeddingCollection as EmbeddingCollection
from recship.trainer.feature_processors import FeatureProcessedEmbeddingBagCollection as OriginalFeatureProcessedEmbeddingBagCollection
from recship.trainer.feature_processors import FeatureProcessorsCollection


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


__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "FeatureProcessorsCollection", "OriginalFeatureProcessedEmbeddingBagCollection",
           "quant_prep_enable_quant_state_dict_split_scale_bias",
           "quant_prep_enable_quant_state_dict_split_scale_bias_for_types", "quant_prep_enable_register_tbes"]
