"""Training side: embedding tables and their configs, sharding plans, sharded modules, DMP."""

from recship.trainer.distributed import ShardedEmbeddingBagCollection
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
from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
from recship.trainer.model_parallel import (
    DistributedModelParallel,
    FusedOptimizer,
    in_backward_optimizer_filter,
)
from recship.trainer.planner import (
    EmbeddingComputeKernel,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
    Topology,
)
from recship.trainer.types import DataType, PoolingType

__all__ = [
    "BaseEmbeddingConfig",
    "DataType",
    "DistributedModelParallel",
    "EmbOptimType",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingComputeKernel",
    "EmbeddingConfig",
    "EmbeddingShardingPlanner",
    "FusedOptimizer",
    "FusedOptimizerConfig",
    "ParameterConstraints",
    "ParameterSharding",
    "PoolingType",
    "ShardMetadata",
    "ShardedEmbeddingBagCollection",
    "ShardingPlan",
    "ShardingType",
    "Topology",
    "in_backward_optimizer_filter",
    "materialize",
]
