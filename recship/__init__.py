"""recship: train, quantize, export and serve recommendation models with large embedding tables.

The public names follow TorchRec's tutorials; recship is built on torch and
fbgemm_gpu only. fbgemm_gpu is imported lazily by the parts that need it, so
``import recship`` stays fast.
"""

from recship.quantize.quantizer import QuantConfig
from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.trainer import (
    DataType,
    DistributedModelParallel,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    EmbeddingShardingPlanner,
    EmbOptimType,
    FusedOptimizerConfig,
    ParameterConstraints,
    PoolingType,
    ShardingPlan,
    ShardingType,
    Topology,
    materialize,
)

from recship import distributed  # noqa: E402,F401  (torchrec.distributed's counterpart, as recship.distributed)

__version__ = "0.1.0"

__all__ = [
    "DataType",
    "DistributedModelParallel",
    "EmbOptimType",
    "EmbeddingShardingPlanner",
    "FusedOptimizerConfig",
    "ParameterConstraints",
    "ShardingPlan",
    "ShardingType",
    "Topology",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "PoolingType",
    "QuantConfig",
    "materialize",
    "__version__",
]
