"""Training side: sharding plans, sharded modules, DMP, fused optimizers (the unsharded modules and their configs
live in ``recship.modules``; their names are re-exported here).

Names load on first use (PEP 562): ``recship train --help`` imports ``recship.trainer.config``
without torch, and ``from recship.trainer import EmbeddingBagCollection`` still works.
"""

from typing import TYPE_CHECKING

from recship.lazy import lazy_names

# public name -> the module that defines it
_NAMES = {
    "ShardedEmbeddingBagCollection": "recship.trainer.distributed",
    **dict.fromkeys(["EmbeddingBagCollectionSharder", "get_default_sharders"], "recship.trainer.distributed.sharders"),
    **dict.fromkeys(["LazyAwaitable", "ModuleSharder", "ShardingEnv"], "recship.trainer.distributed.types"),
    **dict.fromkeys(["BaseEmbeddingConfig", "EmbeddingBagConfig", "EmbeddingConfig"], "recship.modules.embedding_configs"),
    **dict.fromkeys(["EmbeddingBagCollection", "EmbeddingCollection", "materialize"], "recship.modules.embedding_modules"),
    **dict.fromkeys(
        ["CombinedOptimizer", "EmbOptimType", "FusedOptimizerConfig", "KeyedOptimizer", "RowWiseAdagrad"], "recship.trainer.fused_optim"
    ),
    **dict.fromkeys(["DistributedModelParallel", "in_backward_optimizer_filter"], "recship.trainer.model_parallel"),
    **dict.fromkeys(
        [
            "EmbeddingComputeKernel", "EmbeddingShardingPlanner", "ParameterConstraints", "ParameterSharding",
            "ShardingPlan", "ShardingType", "ShardMetadata", "Topology",
        ],
        "recship.trainer.planner",
    ),
    **dict.fromkeys(["DataType", "PoolingType"], "recship.names"),
}

__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_names(__name__, _NAMES, globals())


if TYPE_CHECKING:  # what __getattr__ returns, for type checkers
    from recship.trainer.distributed import ShardedEmbeddingBagCollection as ShardedEmbeddingBagCollection
    from recship.trainer.distributed.sharders import EmbeddingBagCollectionSharder as EmbeddingBagCollectionSharder
    from recship.trainer.distributed.sharders import get_default_sharders as get_default_sharders
    from recship.trainer.distributed.types import LazyAwaitable as LazyAwaitable, ModuleSharder as ModuleSharder
    from recship.trainer.distributed.types import ShardingEnv as ShardingEnv
    from recship.modules.embedding_configs import BaseEmbeddingConfig as BaseEmbeddingConfig
    from recship.modules.embedding_configs import EmbeddingBagConfig as EmbeddingBagConfig, EmbeddingConfig as EmbeddingConfig
    from recship.modules.embedding_modules import EmbeddingBagCollection as EmbeddingBagCollection
    from recship.modules.embedding_modules import EmbeddingCollection as EmbeddingCollection, materialize as materialize
    from recship.trainer.fused_optim import CombinedOptimizer as CombinedOptimizer, EmbOptimType as EmbOptimType
    from recship.trainer.fused_optim import FusedOptimizerConfig as FusedOptimizerConfig, KeyedOptimizer as KeyedOptimizer
    from recship.trainer.fused_optim import RowWiseAdagrad as RowWiseAdagrad
    from recship.trainer.model_parallel import DistributedModelParallel as DistributedModelParallel
    from recship.trainer.model_parallel import in_backward_optimizer_filter as in_backward_optimizer_filter
    from recship.trainer.planner import EmbeddingComputeKernel as EmbeddingComputeKernel
    from recship.trainer.planner import EmbeddingShardingPlanner as EmbeddingShardingPlanner
    from recship.trainer.planner import ParameterConstraints as ParameterConstraints, ParameterSharding as ParameterSharding
    from recship.trainer.planner import ShardingPlan as ShardingPlan, ShardingType as ShardingType
    from recship.trainer.planner import ShardMetadata as ShardMetadata, Topology as Topology
    from recship.modules.types import DataType as DataType, PoolingType as PoolingType
