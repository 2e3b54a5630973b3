"""The distributed API under one name: what TorchRec spreads over ``torchrec.distributed.*`` and ``torchrec.optim``.

    from recship.distributed import (DistributedModelParallel, EmbeddingBagCollectionSharder,
                                     EmbeddingShardingPlanner, ShardingEnv, Topology)

TorchRec code imports these from ``torchrec.distributed.embeddingbag``, ``.embedding``,
``.model_parallel``, ``.planner``, ``.planner.types``, ``.types``,
``.embedding_types``, ``.shard``, ``.sharding_plan`` and ``torchrec.optim``; in recship they are all
here (README: "Coming from TorchRec"). The implementations live in
``recship.trainer`` (training) and ``recship.quantize`` (inference sharding).
"""

from typing import Optional, Sequence, Union

# fbgemm's enums, which TorchRec re-exports in torchrec.distributed.types. recship's lookups always check ids as FATAL
# does: its training sharders refuse a bounds-check setting, its inference sharders take FUSED_PARAM_BOUNDS_CHECK_MODE
# and check all the same. CacheAlgorithm goes in a CacheParams, which recship refuses.
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, CacheAlgorithm
import torch
from torch import nn

from recship.trainer.distributed.sharded_ebc import EmbeddingBagCollectionAwaitable, ShardedEmbeddingBagCollection
from recship.trainer.distributed.sharders import BaseEmbeddingSharder, EmbeddingBagCollectionSharder, EmbeddingCollectionSharder, get_default_sharders
from recship.trainer.distributed.sharded_ec import EmbeddingCollectionAwaitable, EmbeddingCollectionContext, ShardedEmbeddingCollection
from recship.trainer.distributed.fp_sharder import FeatureProcessedEmbeddingBagCollectionSharder
from recship.trainer.distributed.fused_sharder import FusedEmbeddingBagCollectionSharder, ShardedFusedEmbeddingBagCollection
from recship.trainer.distributed.mc_sharder import (BaseShardedManagedCollisionEmbeddingCollection, ManagedCollisionCollectionSharder,
                                                    ManagedCollisionEmbeddingBagCollectionSharder, ManagedCollisionEmbeddingCollectionSharder,
                                                    ShardedManagedCollisionCollection, ShardedManagedCollisionEmbeddingBagCollection,
                                                    ShardedManagedCollisionEmbeddingCollection)
from recship.trainer.distributed.types import Awaitable, LazyAwaitable, ModuleSharder, NoWait, ShardingEnv
from recship.trainer.distributed.types import (FUSED_PARAM_BOUNDS_CHECK_MODE, FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP,
                                               FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS, FUSED_PARAM_REGISTER_TBE_BOOL,
                                               get_propogate_device, set_propogate_device)
from recship.names import DataType  # TorchRec's torchrec.distributed.types re-exports it
# TorchRec's inference sharders (torchrec.distributed.quant_embeddingbag / quant_embedding)
from recship.quantize.sharded import shard_modules as _shard_quantized
from recship.quantize.sharders import (InferManagedCollisionCollectionSharder, QuantEmbeddingBagCollectionSharder, QuantEmbeddingCollectionSharder,
                                       QuantFeatureProcessedEmbeddingBagCollectionSharder, QuantManagedCollisionEmbeddingBagCollectionSharder,
                                       QuantManagedCollisionEmbeddingCollectionSharder, ShardedQuantEmbeddingBagCollection)
from recship.trainer.fused_optim import CombinedOptimizer, EmbeddingFusedOptimizer, EmbOptimType, FusedOptimizerConfig
from recship.trainer.fused_optim import (EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule, KeyedOptimizer,
                                        KeyedOptimizerWrapper, OptimizerWrapper, RowWiseAdagrad, apply_optimizer_in_backward)
from recship.trainer.clipping import GradientClipping, GradientClippingOptimizer
from recship.trainer.model_parallel import (DataParallelWrapper, DefaultDataParallelWrapper, DistributedModelParallel,
                                           in_backward_optimizer_filter, init_parameters)
from recship.trainer.model_parallel import shard_modules as _shard_for_training
from recship.trainer.planner import EmbeddingComputeKernel, EmbeddingShardingPlanner, ParameterConstraints, ParameterSharding
from recship.trainer.planner import ShardingPlan, ShardingType, ShardMetadata, Topology
from recship.trainer.planner.components import (EmbeddingEnumerator, FixedPercentageStorageReservation, GreedyProposer,
                                               GridSearchProposer, HeuristicalStorageReservation, PlannerError,
                                               PlannerErrorType, StorageReservation, UniformProposer)
from recship.trainer.planner.components import (DynamicProgrammingProposer, EmbeddingOffloadScaleupProposer,
                                               EmbeddingPerfEstimator, EmbeddingStorageEstimator, GreedyPerfPartitioner,
                                               Enumerator, Partitioner, PipelineType, Proposer, ShardEstimator, ShardingPlanner,
                                               SortBy)
from recship.trainer.planner.types import EmbeddingModuleShardingPlan, ModuleShardingPlan
from recship.trainer.planner.sharding_plan import (calculate_shard_sizes_and_offsets, get_module_to_default_sharders,
                                                   get_sharding_constructor_from_type, placement, placement_helper)
from recship.trainer.planner.sharding_plan import (apply_to_all, column_wise, construct_module_sharding_plan, data_parallel, grid_shard,
                                                   row_wise, table_row_wise, table_wise)
from recship.trainer.distributed.sharded_module import (CommType, QCommsConfig, get_qcomm_codecs, get_qcomm_codecs_registry)
from recship.trainer.distributed.sharded_module import (EC_INDEX_DEDUP, ShardedEmbeddingModule, get_ec_index_dedup, pad_vbe_kjt_lengths,
                                                       set_ec_index_dedup)
from recship.trainer.distributed.sharded_module import (CommOp, DeviceToHostTensorAwaitable, EmbeddingEvent, GenericMeta,
                                                       GetItemLazyAwaitable, LazyGetItemMixin, LazyNoWait, ModuleNoCopyMixin,
                                                       NoOpQuantizedCommCodec, NullShardedModuleContext, NullShardingContext,
                                                       QuantizedCommCodec, QuantizedCommCodecs, ShardedModule, ShardedModuleContext,
                                                       get_tensor_size_bytes, rank_device)
from recship.trainer.planner.constants import *  # noqa: F401,F403 - TorchRec's planner constants and unit helpers
from recship.trainer.planner.types import (CacheParams, CacheStatistics, ComputeDevice, ComputeKernel, KeyValueParams,
                                           ParameterStorage, ShardingBucketMetadata, ShardingStrategy, StorageUsageType)
from recship.trainer.train_pipeline import TrainPipeline, TrainPipelineBase, TrainPipelineContext, TrainPipelineSparseDist
from recship.trainer.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage
from recship.trainer.optimizers import LAMB, SGD, Adagrad, Adam, LarsSGD, PartialRowWiseAdam, PartialRowWiseLAMB, adagrad
from recship.trainer.semi_sync import (SEMI_SYNC_GLOBAL_OPTIM_KEY, SEMI_SYNC_GLOBAL_STATE_KEY, SEMI_SYNC_LOCAL_OPTIM_KEY,
                                      SEMI_SYNC_LOCAL_STATE_KEY, SEMISYNC_GLOBAL_STEP_COUNTER_KEY, SEMISYNC_LOCAL_STEP_COUNTER_KEY,
                                      SemisyncOptimizer)
from recship.trainer.comm import (get_group_rank, get_local_rank, get_local_size, get_node_group_size, get_num_groups,
                                  get_topology_domain_multiple, get_topology_group_world_size, intra_and_cross_node_pg)
from recship.trainer.distributed.model_utils import (add_prefix_to_state_dict, copy_to_device, filter_state_dict, get_module,
                                                    get_unsharded_module_names, get_unwrapped_module, sharded_model_copy)
from recship.trainer.train_pipeline import DataLoadingThread, EvalPipelineSparseDist
from recship.trainer.gradient_accumulation import GradientAccumulationConfig, GradientAccumulationWrapper
from recship.trainer.hybrid_eval import HybridEvalDMP
from recship.trainer.planner.types import ObjectPoolShardingPlan, ObjectPoolShardingType


def shard_modules(
    module: nn.Module,
    env: Optional[ShardingEnv] = None,
    device: Optional[torch.device] = None,
    plan: Optional[ShardingPlan] = None,
    sharders: Optional[Sequence[ModuleSharder]] = None,
    init_params: bool = False,
) -> nn.Module:
    """TorchRec's ``torchrec.distributed.shard.shard_modules``: ``module`` with its embedding collections sharded in
    place and no data-parallel wrapper (``recship.trainer.model_parallel.shard_modules``); a quantized model
    (QuantEmbeddingBagCollections) is sharded for inference, as ``_shard_modules``."""
    if any(type(m).__module__.startswith("recship.quantize") for m in module.modules()):
        if init_params:
            raise ValueError("shard_modules(init_params=True) of a quantized model: its tables are already filled")
        return _shard_modules(module, env=env, device=device, plan=plan, sharders=list(sharders) if sharders else None)
    return _shard_for_training(module, env, device, plan, sharders, init_params)


def _shard_modules(
    module: nn.Module,
    env: Optional[ShardingEnv] = None,
    device: Union[None, str, torch.device] = None,
    plan: Optional[ShardingPlan] = None,
    sharders: Optional[list] = None,
) -> nn.Module:
    """TorchRec's ``torchrec.distributed.shard._shard_modules``: inference sharding of a quantized model
    (``recship.quantize.sharded.shard_modules``)."""
    return _shard_quantized(module, env=env, device=device, plan=plan, sharders=sharders)


__all__ = [
    "Awaitable", "CombinedOptimizer", "DistributedModelParallel", "EmbOptimType", "EmbeddingBagCollectionAwaitable",
    "EmbeddingBagCollectionSharder", "FeatureProcessedEmbeddingBagCollectionSharder", "EmbeddingComputeKernel", "EmbeddingFusedOptimizer", "EmbeddingShardingPlanner",
    "FusedOptimizerConfig", "KeyedOptimizer", "LazyAwaitable", "ModuleSharder", "NoWait", "ParameterConstraints",
    "ParameterSharding", "RowWiseAdagrad", "ShardMetadata", "ShardedEmbeddingBagCollection", "ShardingEnv",
    "ShardingPlan", "ShardingType", "Topology", "get_default_sharders", "in_backward_optimizer_filter",
    "GradientClipping", "GradientClippingOptimizer", "KeyedOptimizerWrapper", "OptimizerWrapper", "apply_optimizer_in_backward",
    "apply_to_all", "column_wise", "construct_module_sharding_plan", "data_parallel", "row_wise", "table_row_wise", "table_wise",
    "TrainPipeline", "TrainPipelineBase", "TrainPipelineContext", "TrainPipelineSparseDist",
    "WarmupOptimizer", "WarmupPolicy", "WarmupStage",
    "EmbeddingEnumerator", "FixedPercentageStorageReservation", "GreedyProposer", "GridSearchProposer",
    "HeuristicalStorageReservation", "PlannerError", "PlannerErrorType", "StorageReservation", "UniformProposer",
    "EmbeddingCollectionSharder", "BaseEmbeddingSharder", "EmbeddingCollectionAwaitable", "EmbeddingCollectionContext",
    "ShardedEmbeddingCollection",
    "ManagedCollisionCollectionSharder", "ManagedCollisionEmbeddingBagCollectionSharder", "ManagedCollisionEmbeddingCollectionSharder",
    "ShardedManagedCollisionCollection", "BaseShardedManagedCollisionEmbeddingCollection", "ShardedManagedCollisionEmbeddingBagCollection",
    "ShardedManagedCollisionEmbeddingCollection",
    "DataParallelWrapper", "DefaultDataParallelWrapper", "DynamicProgrammingProposer", "EmbeddingModuleShardingPlan",
    "EmbeddingOffloadScaleupProposer", "EmbeddingPerfEstimator", "EmbeddingStorageEstimator", "GreedyPerfPartitioner",
    "ModuleShardingPlan", "Partitioner", "PipelineType", "Proposer", "ShardEstimator", "SortBy", "grid_shard", "shard_modules",
    "Enumerator", "ShardingPlanner",
    "_shard_modules",  # TorchRec's name for it, underscore included
    "Adagrad", "Adam", "LAMB", "LarsSGD", "PartialRowWiseAdam", "PartialRowWiseLAMB", "SGD", "adagrad",
    "EmptyFusedOptimizer", "FusedOptimizer", "FusedOptimizerModule",
    "SEMI_SYNC_GLOBAL_OPTIM_KEY", "SEMI_SYNC_GLOBAL_STATE_KEY", "SEMI_SYNC_LOCAL_OPTIM_KEY", "SEMI_SYNC_LOCAL_STATE_KEY",
    "SEMISYNC_GLOBAL_STEP_COUNTER_KEY", "SEMISYNC_LOCAL_STEP_COUNTER_KEY", "SemisyncOptimizer",
    "get_group_rank", "get_local_rank", "get_local_size", "get_node_group_size", "get_num_groups", "get_topology_domain_multiple",
    "get_topology_group_world_size", "intra_and_cross_node_pg", "get_module", "get_unsharded_module_names", "get_unwrapped_module",
    "sharded_model_copy", "DataLoadingThread", "EvalPipelineSparseDist",
    "add_prefix_to_state_dict", "copy_to_device", "filter_state_dict",
    "CommOp", "DeviceToHostTensorAwaitable", "EmbeddingEvent", "GenericMeta", "GetItemLazyAwaitable", "LazyGetItemMixin",
    "LazyNoWait", "ModuleNoCopyMixin", "NoOpQuantizedCommCodec", "NullShardedModuleContext", "NullShardingContext",
    "QuantizedCommCodec", "QuantizedCommCodecs", "ShardedModule", "ShardedModuleContext", "get_tensor_size_bytes",
    "rank_device", "CacheParams", "CacheStatistics", "ComputeDevice", "ComputeKernel", "KeyValueParams", "ParameterStorage",
    "ShardingBucketMetadata", "ShardingStrategy", "StorageUsageType",
    "CommType", "QCommsConfig", "get_qcomm_codecs", "get_qcomm_codecs_registry",
    "calculate_shard_sizes_and_offsets", "get_module_to_default_sharders", "get_sharding_constructor_from_type",
    "placement", "placement_helper",
    "EC_INDEX_DEDUP", "ShardedEmbeddingModule", "get_ec_index_dedup", "pad_vbe_kjt_lengths", "set_ec_index_dedup",
    "FUSED_PARAM_BOUNDS_CHECK_MODE", "FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP", "FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS",
    "FUSED_PARAM_REGISTER_TBE_BOOL", "init_parameters", "get_propogate_device", "DataType", "set_propogate_device",
    "GradientAccumulationConfig", "GradientAccumulationWrapper", "ObjectPoolShardingPlan", "ObjectPoolShardingType",
    "FusedEmbeddingBagCollectionSharder", "ShardedFusedEmbeddingBagCollection",
    "HybridEvalDMP", "BoundsCheckMode", "CacheAlgorithm",
    "InferManagedCollisionCollectionSharder", "QuantEmbeddingBagCollectionSharder", "QuantEmbeddingCollectionSharder",
    "QuantFeatureProcessedEmbeddingBagCollectionSharder", "QuantManagedCollisionEmbeddingBagCollectionSharder",
    "QuantManagedCollisionEmbeddingCollectionSharder", "ShardedQuantEmbeddingBagCollection",
]
