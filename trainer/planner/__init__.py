"""Sharding plans: the vocabulary (types) and the planner that proposes one."""

from recship.trainer.planner.planner import (
    DEFAULT_SHARDING_TYPES,
    EmbeddingShardingPlanner,
    column_block_count,
    column_blocks,
    host_ranks,
    row_blocks,
    shard_bytes,
    shard_cost,
)
from recship.trainer.planner.types import (
    EmbeddingComputeKernel,
    ParameterConstraints,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
    Topology,
)

__all__ = [
    "DEFAULT_SHARDING_TYPES",
    "EmbeddingComputeKernel",
    "EmbeddingShardingPlanner",
    "ParameterConstraints",
    "ParameterSharding",
    "ShardMetadata",
    "ShardingPlan",
    "ShardingType",
    "Topology",
    "column_block_count",
    "column_blocks",
    "host_ranks",
    "row_blocks",
    "shard_bytes",
    "shard_cost",
]
