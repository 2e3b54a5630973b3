"""TorchRec's ``torchrec.inference.modules`` names on recship's quantizer and inference sharding (the import map sends
every ``torchrec.inference`` path here):

    model = quantize_inference_model(model)                       # EBCs and ECs -> their quantized twins (INT8)
    sharded, plan = shard_quant_model(model, world_size=2, compute_device="cpu")

``recship export`` runs the same steps (and validates and writes the artifact); these are for code that does them by hand.
"""

from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from recship.names import DataType, EmbeddingComputeKernel, ShardingType
from recship.trainer.planner.types import ParameterConstraints, ParameterSharding, ShardingPlan, ShardMetadata
from recship.trainer.feature_processors import FeatureProcessedEmbeddingBagCollection  # noqa: F401 (TorchRec's name here)


def quantize_inference_model(model: nn.Module, quantization_mapping: Optional[Dict[str, type]] = None,
                             per_table_weight_dtype: Optional[Dict[str, torch.dtype]] = None, fp_weight_dtype: torch.dtype = torch.int8,
                             quantization_dtype: torch.dtype = torch.int8, output_dtype: torch.dtype = torch.float) -> nn.Module:
    """Swaps, in place, every EmbeddingBagCollection and EmbeddingCollection of ``model`` for its quantized twin,
    tables in ``quantization_dtype`` (``torch.int8``, ``torch.quint4x2`` for INT4, ``torch.quint2x4`` for INT2,
    ``torch.float16``) or their ``per_table_weight_dtype``; returns the model. recship's quantized collections
    answer float32 and are its own: ``output_dtype`` must be float32 and ``quantization_mapping`` None
    (``fp_weight_dtype``, for TorchRec's feature-processed collections, has nothing to apply to)."""
    from recship.quantize import quantize_embeddings

    if quantization_mapping is not None:
        raise ValueError("quantize_inference_model: quantization_mapping is not taken: recship swaps in its own quantized "
                         "collections (recship.quantize)")
    if output_dtype != torch.float:
        raise ValueError(f"quantize_inference_model: output_dtype {output_dtype}: recship's quantized collections answer float32")
    tables: Dict[str, Union[str, DataType]] = {name: DataType.from_quant_dtype(dtype)
                                                for name, dtype in (per_table_weight_dtype or {}).items()}
    quantized, _ = quantize_embeddings(model, dtype=DataType.from_quant_dtype(quantization_dtype), table_dtypes=tables,
                                       inplace=True)
    return quantized


def shard_quant_model(model: nn.Module, world_size: int = 1, compute_device: str = "cuda", sharding_device: str = "meta",
                      sharders: Optional[list] = None, device_memory_size: Optional[int] = None,
                      constraints: Optional[Dict[str, ParameterConstraints]] = None) -> Tuple[nn.Module, ShardingPlan]:
    """Inference sharding of a quantized model over ``world_size`` devices of ``compute_device`` ("cuda": cuda:0..;
    "cpu": host-memory shards), as TorchRec's: (the sharded model, its ShardingPlan). Each table goes table-wise
    on the least-loaded device, or as the first of its ``constraints``' sharding types (table_wise, row_wise,
    column_wise). The model is sharded in place; ``sharding_device`` (where TorchRec plans) changes nothing here,
    and ``sharders`` and ``device_memory_size`` are not taken."""
    from recship.quantize.sharded import shard_quant_model as shard

    if sharders is not None or device_memory_size is not None:
        raise ValueError("shard_quant_model: sharders and device_memory_size are not taken: recship places the shards itself")
    sharding: Dict[str, Union[str, ShardingType]] = {name: ShardingType(c.sharding_types[0])
                                                     for name, c in (constraints or {}).items() if c.sharding_types}
    devices: Optional[List[Union[str, torch.device]]] = None
    if compute_device == "cuda":
        devices = [f"cuda:{i}" for i in range(world_size)]
    elif compute_device != "cpu":
        raise ValueError(f"shard_quant_model: compute_device must be cuda or cpu, got {compute_device!r}")
    sharded, placed = shard(model, devices=devices, shards=None if devices is not None else world_size,
                            sharding=sharding or None, inplace=True)
    plan: Dict[str, Dict[str, ParameterSharding]] = {}
    for path, tables in placed.items():
        plan[path] = {}
        for table, shards in tables.items():
            # one block: table-wise; blocks side by side: column-wise; else row-wise
            kind = (ShardingType.TABLE_WISE if len(shards) == 1 else ShardingType.COLUMN_WISE
                    if len({s.col_offset for s in shards}) > 1 else ShardingType.ROW_WISE)
            plan[path][table] = ParameterSharding(kind, EmbeddingComputeKernel.FUSED, [s.device for s in shards], [
                ShardMetadata([s.row_offset, s.col_offset], [s.rows, s.cols], s.device,
                              "cpu" if compute_device == "cpu" else f"cuda:{s.device}") for s in shards])
    return sharded, ShardingPlan(plan)
