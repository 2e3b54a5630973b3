"""Training side: embedding tables and their configs, sharding plans, sharded modules, DMP."""

from recship.trainer.distributed import ShardedEmbeddingBagCollection
from recship.trainer.distributed.sharders import EmbeddingBagCollectionSharder, get_default_sharders
from recship.trainer.distributed.types import LazyAwaitable, ModuleSharder, ShardingEnv
from recship.trainer.embedding_configs import (
    BaseEmbeddingConfig,
    EmbeddingBagConfig,
    EmbeddingConfig,
)
from recship.trainer.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    materialize,
)
from recship.trainer.fused_optim import (
    CombinedOptimizer,
    EmbOptimType,
    FusedOptimizerConfig,
    KeyedOptimizer,
    RowWiseAdagrad,
)
from recship.trainer.model_parallel import DistributedModelParallel, in_backward_optimizer_filter
from recship.trainer.planner import EmbeddingComputeKernel, EmbeddingShardingPlanner, ParameterConstraints, ParameterSharding
from recship.trainer.planner import ShardingPlan, ShardingType, ShardMetadata, Topology
from recship.trainer.types import DataType, PoolingType

__all__ = [
    "BaseEmbeddingConfig",
    "CombinedOptimizer",
    "DataType",
    "DistributedModelParallel",
    "EmbOptimType",
    "EmbeddingBagCollection",
    "EmbeddingBagCollectionSharder",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingComputeKernel",
    "EmbeddingConfig",
    "EmbeddingShardingPlanner",
    "FusedOptimizerConfig",
    "KeyedOptimizer",
    "LazyAwaitable",
    "ModuleSharder",
    "ParameterConstraints",
    "ParameterSharding",
    "PoolingType",
    "RowWiseAdagrad",
    "ShardMetadata",
    "ShardedEmbeddingBagCollection",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingType",
    "Topology",
    "get_default_sharders",
    "in_backward_optimizer_filter",
    "materialize",
]
