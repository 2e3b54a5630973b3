"""The distributed API under one name: what TorchRec spreads over ``torchrec.distributed.*`` and ``torchrec.optim``.

    from recship.distributed import (DistributedModelParallel, EmbeddingBagCollectionSharder,
                                     EmbeddingShardingPlanner, ShardingEnv, Topology)

TorchRec code imports these from ``torchrec.distributed.embeddingbag``,
``.model_parallel``, ``.planner``, ``.planner.types``, ``.types``,
``.embedding_types``, ``.shard`` and ``torchrec.optim``; in recship they are all
here (README: "Coming from TorchRec"). The implementations live in
``recship.trainer`` (training) and ``recship.export`` (inference sharding).
"""

from recship.export.sharded import _shard_modules
from recship.trainer.distributed.sharded_ebc import EmbeddingBagCollectionAwaitable, ShardedEmbeddingBagCollection
from recship.trainer.distributed.sharders import EmbeddingBagCollectionSharder, get_default_sharders
from recship.trainer.distributed.types import Awaitable, LazyAwaitable, ModuleSharder, NoWait, ShardingEnv
from recship.trainer.fused_optim import (
    CombinedOptimizer,
    EmbeddingFusedOptimizer,
    EmbOptimType,
    FusedOptimizerConfig,
    KeyedOptimizer,
    RowWiseAdagrad,
)
from recship.trainer.model_parallel import DistributedModelParallel, in_backward_optimizer_filter
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

__all__ = [
    "Awaitable",
    "CombinedOptimizer",
    "DistributedModelParallel",
    "EmbOptimType",
    "EmbeddingBagCollectionAwaitable",
    "EmbeddingBagCollectionSharder",
    "EmbeddingComputeKernel",
    "EmbeddingFusedOptimizer",
    "EmbeddingShardingPlanner",
    "FusedOptimizerConfig",
    "KeyedOptimizer",
    "LazyAwaitable",
    "ModuleSharder",
    "NoWait",
    "ParameterConstraints",
    "ParameterSharding",
    "RowWiseAdagrad",
    "ShardMetadata",
    "ShardedEmbeddingBagCollection",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingType",
    "Topology",
    "get_default_sharders",
    "in_backward_optimizer_filter",
    "_shard_modules",
]
