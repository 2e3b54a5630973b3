"""recship: train, quantize, export and serve recommendation models with large embedding tables.

The public names follow TorchRec's tutorials; recship is built on torch and
fbgemm_gpu only. Names and subpackages load on first use (PEP 562), so
``import recship``, ``recship --version`` and the gRPC client (numpy + grpc) do
not load torch; fbgemm_gpu is imported by the parts that need it.
"""

import importlib
from typing import TYPE_CHECKING, Any, List

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor"], "recship.sparse"),
    **dict.fromkeys(
        [
            "DataType", "DistributedModelParallel", "EmbOptimType", "EmbeddingBagCollection", "EmbeddingBagConfig",
            "EmbeddingCollection", "EmbeddingConfig", "EmbeddingShardingPlanner", "FusedOptimizerConfig",
            "ParameterConstraints", "PoolingType", "ShardingPlan", "ShardingType", "Topology", "materialize",
        ],
        "recship.trainer",
    ),
    "QuantConfig": "recship.quantize.quantizer",
}
_SUBMODULES = ["cli", "demo", "distributed", "export", "fx", "models", "quantize", "serving", "sparse", "trainer"]

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"recship.{name}")
    raise AttributeError(f"module 'recship' has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))


if TYPE_CHECKING:  # what __getattr__ returns, for type checkers
    from recship import distributed as distributed
    from recship.quantize.quantizer import QuantConfig as QuantConfig
    from recship.sparse import JaggedTensor as JaggedTensor, KeyedJaggedTensor as KeyedJaggedTensor, KeyedTensor as KeyedTensor
    from recship.trainer import DataType as DataType, DistributedModelParallel as DistributedModelParallel
    from recship.trainer import EmbeddingBagCollection as EmbeddingBagCollection, EmbeddingBagConfig as EmbeddingBagConfig
    from recship.trainer import EmbeddingCollection as EmbeddingCollection, EmbeddingConfig as EmbeddingConfig
    from recship.trainer import EmbeddingShardingPlanner as EmbeddingShardingPlanner, EmbOptimType as EmbOptimType
    from recship.trainer import FusedOptimizerConfig as FusedOptimizerConfig, ParameterConstraints as ParameterConstraints
    from recship.trainer import PoolingType as PoolingType, ShardingPlan as ShardingPlan, ShardingType as ShardingType
    from recship.trainer import Topology as Topology, materialize as materialize
