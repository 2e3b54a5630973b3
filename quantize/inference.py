"""TorchRec's ``torchrec.inference.modules`` quantization helpers on recship's quantized collections
(``recship.inference`` re-exports them under TorchRec's names):

    model = quantize_inference_model(model)           # EBC / EC / FP-EBC -> their quantized twins (INT8), in place
    model = quantize_embeddings(model, dtype=torch.qint8, inplace=True)    # EBCs only, through torch's quantize_dynamic
    set_pruning_data(model, {"t0": 1000})             # before quantizing: t0 keeps its first 1000 rows

Both quantizers go through torch's ``quantize_dynamic`` with a QuantConfig and ``from_float``, as TorchRec's, so the
stored rows are those of TorchRec 1.8.0's quantized modules (fbgemm's row-wise quantization, rows padded to 16 bytes).
``output_dtype`` (torch.float, torch.half, torch.bfloat16) is TorchRec's; a model quantized with another than
torch.float stays in eager use (export, serving and inference sharding take float32 outputs). What differs: a
collection on ``meta`` quantizes to zero rows on the CPU, to be loaded (TorchRec keeps them on meta).
"""

import logging
from typing import Any, Dict, List, Optional, Tuple, Type

from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
import torch
from torch import nn
from torch.ao.quantization import PlaceholderObserver, quantize_dynamic

from recship.contract.tables import split_shard
from recship.quantize.feature_processed import QuantFeatureProcessedEmbeddingBagCollection
from recship.quantize.modules import PRUNING_ATTR, REGISTER_TBES_ATTR, QuantEmbeddingBagCollection, QuantEmbeddingCollection
from recship.quantize.quantizer import QuantConfig, check_output_dtype
from recship.quantize.tbe import QuantTables
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.feature_processors import FeatureProcessedEmbeddingBagCollection

logger = logging.getLogger(__name__)

MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT = PRUNING_ATTR
DEFAULT_QUANTIZATION_DTYPE: torch.dtype = torch.int8


def trim_torch_package_prefix_from_typename(typename: str) -> str:
    """``typename`` without the ``<torch_package_N>.`` a class loaded from a torch.package carries in its module."""
    if typename.startswith("<torch_package_"):
        return typename.split(".", 1)[1] if "." in typename else typename
    return typename


DEFAULT_QUANT_MAPPING: Dict[str, Type[nn.Module]] = {
    trim_torch_package_prefix_from_typename(torch.typename(EmbeddingBagCollection)): QuantEmbeddingBagCollection,
    trim_torch_package_prefix_from_typename(torch.typename(EmbeddingCollection)): QuantEmbeddingCollection,
}
# recship's FP-EBC type name (TorchRec's constant names TorchRec's class: torchrec.modules.fp_embedding_modules....)
FEATURE_PROCESSED_EBC_TYPE: str = trim_torch_package_prefix_from_typename(torch.typename(FeatureProcessedEmbeddingBagCollection))


def quantize_feature(module: nn.Module, inputs: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """A forward pre-hook (``quantize_dense`` registers it): float32/float64 tensor inputs become float16."""
    return tuple(x.half() if isinstance(x, torch.Tensor) and x.dtype in (torch.float32, torch.float64) else x for x in inputs)


def _qconfig(weight_dtype: torch.dtype, output_dtype: torch.dtype,
             per_table_weight_dtype: Optional[Dict[str, torch.dtype]]) -> QuantConfig:
    check_output_dtype(output_dtype)
    # min/max rows, as TorchRec's (fbgemm's FloatToFusedNBitRowwiseQuantizedSBHalf): not recship's error-minimising
    # INT4/INT2 clipping, so the stored rows are TorchRec's bytes
    return QuantConfig(activation=PlaceholderObserver.with_args(dtype=output_dtype), error_minimizing=False,
                       weight=PlaceholderObserver.with_args(dtype=weight_dtype), per_table_weight_dtype=per_table_weight_dtype)


def quantize_embeddings(
    module: nn.Module,
    dtype: torch.dtype,
    inplace: bool,
    additional_qconfig_spec_keys: Optional[List[Type[nn.Module]]] = None,
    additional_mapping: Optional[Dict[Type[nn.Module], Type[nn.Module]]] = None,
    output_dtype: torch.dtype = torch.float,
    per_table_weight_dtype: Optional[Dict[str, torch.dtype]] = None,
) -> nn.Module:
    """TorchRec's ``quantize_embeddings``: torch's ``quantize_dynamic`` swaps every EmbeddingBagCollection of
    ``module`` (and the types of ``additional_qconfig_spec_keys`` / ``additional_mapping``) for its quantized twin.

    Args:
        dtype: the tables' type: torch.qint8 / torch.int8 (INT8), torch.quint4x2 (INT4), torch.quint2x4 (INT2),
            torch.float16, torch.float32.
        inplace: swap inside ``module``; otherwise a deep copy is quantized.
        per_table_weight_dtype: table name -> dtype, overriding ``dtype``.
        output_dtype: the quantized collections' output dtype (torch.float, torch.half, torch.bfloat16); export,
            serving and inference sharding take torch.float.

    Unlike ``recship.quantize.quantize_embeddings`` (which quantizes EmbeddingCollections too, and reports the
    error), EmbeddingCollections are left alone unless ``additional_mapping`` maps them, as TorchRec does.
    """
    qconfig = _qconfig(dtype, output_dtype, per_table_weight_dtype)
    spec: Dict[Type[nn.Module], Any] = {EmbeddingBagCollection: qconfig}
    mapping: Dict[Type[nn.Module], Type[nn.Module]] = {EmbeddingBagCollection: QuantEmbeddingBagCollection}
    for t in additional_qconfig_spec_keys or []:
        spec[t] = qconfig
    mapping.update(additional_mapping or {})
    return quantize_dynamic(module, qconfig_spec=spec, mapping=mapping, inplace=inplace)


def quantize_dense(predict_module: nn.Module, dtype: torch.dtype,
                   additional_embedding_module_type: List[Type[nn.Module]] = []) -> nn.Module:  # noqa: B006 (TorchRec's default)
    """TorchRec's ``quantize_dense``: every direct child of ``predict_module.predict_module`` that is not an embedding
    collection (nor one of ``additional_embedding_module_type``) is cast to float16, with a pre-hook
    (``quantize_feature``) that casts its float inputs. Returns ``predict_module``. Only ``dtype=torch.half``;
    other types raise NotImplementedError, as in TorchRec."""
    module = getattr(predict_module, "predict_module", None)
    if not isinstance(module, nn.Module):
        raise TypeError(f"quantize_dense takes a PredictModule, got {type(predict_module).__name__}")
    embedding_types = (EmbeddingBagCollection, EmbeddingCollection, FeatureProcessedEmbeddingBagCollection, QuantTables)
    swap = {}
    for name, child in module.named_children():
        if isinstance(child, embedding_types) or any(type(child) is t for t in additional_embedding_module_type):
            continue
        if dtype != torch.half:
            raise NotImplementedError("only fp16 is supported for non-embedding module lowering")
        child = child.half()
        child.register_forward_pre_hook(quantize_feature)
        swap[name] = child
    for name, child in swap.items():
        setattr(module, name, child)
    return predict_module


def set_pruning_data(model: nn.Module, tables_to_rows_post_pruning: Dict[str, int],
                     module_types: Optional[List[Type[nn.Module]]] = None) -> nn.Module:
    """Marks every submodule of exactly one of ``module_types`` (default: EmbeddingBagCollection and
    FeatureProcessedEmbeddingBagCollection) so that quantizing it keeps, per named table, its first
    ``tables_to_rows_post_pruning[table]`` rows (the ids must have been remapped into them). Returns ``model``."""
    types = tuple(module_types) if module_types is not None else (EmbeddingBagCollection, FeatureProcessedEmbeddingBagCollection)
    for m in model.modules():
        if type(m) in types:
            setattr(m, PRUNING_ATTR, tables_to_rows_post_pruning)
    return model


def quantize_inference_model(
    model: nn.Module,
    quantization_mapping: Optional[Dict[str, Type[nn.Module]]] = None,
    per_table_weight_dtype: Optional[Dict[str, torch.dtype]] = None,
    fp_weight_dtype: torch.dtype = DEFAULT_QUANTIZATION_DTYPE,
    quantization_dtype: torch.dtype = DEFAULT_QUANTIZATION_DTYPE,
    output_dtype: torch.dtype = torch.float,
) -> nn.Module:
    """TorchRec's ``quantize_inference_model``: in place, every EmbeddingBagCollection and EmbeddingCollection of
    ``model`` becomes its quantized twin (tables in ``quantization_dtype``, or their ``per_table_weight_dtype``),
    every FeatureProcessedEmbeddingBagCollection a QuantFeatureProcessedEmbeddingBagCollection (tables in
    ``fp_weight_dtype``); returns ``model``.

    ``quantization_mapping``: type name (``torch.typename``) -> quantized class, instead of
    ``DEFAULT_QUANT_MAPPING``. As TorchRec's, the quantized modules' state_dicts include their TBEs' buffers
    (``tbes.<i>.*``, TorchRec's ``quant_prep_enable_register_tbes``). ``output_dtype``: as for ``quantize_embeddings``.
    """
    mapping = DEFAULT_QUANT_MAPPING if quantization_mapping is None else quantization_mapping
    spec_keys: List[Type[nn.Module]] = []
    extra: Dict[Type[nn.Module], Type[nn.Module]] = {}
    fp_modules: List[Tuple[str, FeatureProcessedEmbeddingBagCollection]] = []
    for path, m in model.named_modules():
        name = trim_torch_package_prefix_from_typename(torch.typename(m))
        if name in mapping:
            spec_keys.append(type(m))
            extra[type(m)] = mapping[name]
        elif name == FEATURE_PROCESSED_EBC_TYPE:
            assert isinstance(m, FeatureProcessedEmbeddingBagCollection)  # its type name says so
            fp_modules.append((path, m))
    for path, fp in fp_modules:
        setattr(fp, REGISTER_TBES_ATTR, True)
        setattr(fp, "qconfig", _qconfig(fp_weight_dtype, output_dtype, per_table_weight_dtype))
        quantized = QuantFeatureProcessedEmbeddingBagCollection.from_float(fp)
        if not path:
            return quantized
        model.set_submodule(path, quantized)
    for m in model.modules():
        if type(m) in extra:
            setattr(m, REGISTER_TBES_ATTR, True)
    quantized_model = quantize_embeddings(model, dtype=quantization_dtype, additional_qconfig_spec_keys=spec_keys,
                                          additional_mapping=extra, inplace=True, per_table_weight_dtype=per_table_weight_dtype,
                                          output_dtype=output_dtype)
    logger.info("Default quantization dtype is %s, per_table_weight_dtype=%s.", quantization_dtype, per_table_weight_dtype)
    return quantized_model


def get_table_to_weights_from_tbe(model: nn.Module) -> Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """table name -> (stored rows [rows, row bytes] uint8, scale/bias [rows, 4] uint8 or None) of every fbgemm
    inference TBE in ``model``: views of the rows, as fbgemm's ``split_embedding_weights`` gives them."""
    out: Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
    for m in model.modules():
        if isinstance(m, IntNBitTableBatchedEmbeddingBagsCodegen):
            for spec, weights in zip(m.embedding_specs, m.split_embedding_weights()):
                out[spec[0]] = weights
    return out


def assign_weights_to_tbe(model: nn.Module, table_to_weight: Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]) -> None:
    """Copies ``table_to_weight`` (as ``get_table_to_weights_from_tbe`` gives it) into every fbgemm inference TBE of
    ``model``; ValueError names a table of a TBE that it lacks."""
    for m in model.modules():
        if isinstance(m, IntNBitTableBatchedEmbeddingBagsCodegen):
            found = [_block_weights(spec[0], current[0], table_to_weight)
                     for spec, current in zip(m.embedding_specs, m.split_embedding_weights())]
            missing = [spec[0] for spec, w in zip(m.embedding_specs, found) if w is None]
            if missing:
                raise ValueError(f"assign_weights_to_tbe: no weights for tables {missing}")
            m.assign_embedding_weights(found)


def _block_weights(name: str, current: torch.Tensor, table_to_weight: Dict[str, Any]) -> Any:
    """The weights for the TBE table ``name``: its own entry, or, for a sharded model's block ``<table>@<k>`` that holds
    its whole table (table-wise sharding; TorchRec names such a TBE table by the table), the table's. A block holding
    part of a table (row- or column-wise) is a ValueError: its rows are a slice the whole table's weights do not give."""
    if name in table_to_weight:
        return table_to_weight[name]
    table, index = split_shard(name)
    if index is None or table not in table_to_weight:
        return None
    weights = table_to_weight[table]
    if tuple(weights[0].shape) != tuple(current.shape):
        raise ValueError(f"assign_weights_to_tbe: {name!r} is a block of table {table!r} ({tuple(current.shape)} bytes "
                         f"of its {tuple(weights[0].shape)}): only a table-wise block takes its table's weights")
    return weights

