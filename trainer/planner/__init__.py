"""Sharding plans: the vocabulary (types) and the planner that proposes one."""

from recship.trainer.planner.planner import EmbeddingShardingPlanner, column_blocks, row_blocks
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
    "EmbeddingComputeKernel",
    "EmbeddingShardingPlanner",
    "ParameterConstraints",
    "ParameterSharding",
    "ShardMetadata",
    "ShardingPlan",
    "ShardingType",
    "Topology",
    "column_blocks",
    "row_blocks",
]
