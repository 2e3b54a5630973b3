"""EmbeddingShardingPlanner: choose how every table of every EmbeddingBagCollection is sharded.

Shard geometry (the sharded modules rely on exactly these rules):
- ROW_WISE: block = ceil(rows / world_size); rank r holds rows [r * block, (r + 1) * block)
  clipped to the table; ranks whose block is empty hold no shard.
- TABLE_ROW_WISE: the same over the local ranks of one host.
- COLUMN_WISE: n blocks of widths that are multiples of 4, as even as possible, wider first.
- TABLE_WISE: the whole table on one rank. DATA_PARALLEL: a full replica on every rank.

Memory per rank counts fp32 weights plus the fused optimizer's state (data-parallel
replicas: weights, a dense gradient and a dense optimizer state). Cost per rank is
the number of embedding floats it looks up per step (ids x columns); tables are placed
largest first, each with the allowed option that keeps the busiest rank least busy.
"""

import math
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist
from torch import nn

from recship.trainer.embedding_configs import EmbeddingBagConfig
from recship.trainer.embedding_modules import EmbeddingBagCollection
from recship.trainer.fused_optim import FusedOptimizerConfig
from recship.trainer.planner.types import (
    EmbeddingComputeKernel,
    ParameterConstraints,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
    Topology,
)

_DEFAULT_TYPES = [
    ShardingType.TABLE_WISE,
    ShardingType.ROW_WISE,
    ShardingType.COLUMN_WISE,
    ShardingType.TABLE_ROW_WISE,
]


def row_blocks(rows: int, ranks: List[int]) -> List[Tuple[int, int, int]]:
    """[(rank, row offset, rows)] for a ceil-sized row split over ``ranks`` (empty blocks dropped)."""
    block = math.ceil(rows / len(ranks))
    out = []
    for i, r in enumerate(ranks):
        start = i * block
        if start < rows:
            out.append((r, start, min(rows, start + block) - start))
    return out


def column_blocks(dim: int, n: int) -> List[Tuple[int, int]]:
    """[(column offset, width)] of n blocks whose widths are multiples of 4, wider blocks first."""
    if dim % 4 != 0:
        raise ValueError(f"column-wise sharding needs a dim divisible by 4, got {dim}")
    units = dim // 4
    n = max(1, min(n, units))
    out, offset = [], 0
    for i in range(n):
        width = 4 * (units // n + (1 if i < units % n else 0))
        out.append((offset, width))
        offset += width
    return out


class EmbeddingShardingPlanner:
    """Plans every EmbeddingBagCollection of a module for ``topology``.

    Args:
        topology: ranks, device and memory per rank.
        constraints: table name -> ParameterConstraints.
        optimizer: the fused optimizer (its state counts against memory).
        batch_size: examples per rank per step, for the cost estimate.
    """

    def __init__(
        self,
        topology: Topology,
        constraints: Optional[Dict[str, ParameterConstraints]] = None,
        optimizer: Optional[FusedOptimizerConfig] = None,
        batch_size: int = 512,
    ) -> None:
        self.topology = topology
        self.constraints = dict(constraints or {})
        self.optimizer = optimizer or FusedOptimizerConfig()
        self.batch_size = batch_size

    def plan(self, module: nn.Module) -> ShardingPlan:
        collections = [(p, m) for p, m in module.named_modules() if isinstance(m, EmbeddingBagCollection)]
        tables = [t for _, m in collections for t in m.embedding_bag_configs()]
        unknown = sorted(set(self.constraints) - {t.name for t in tables})
        if unknown:
            raise ValueError(f"constraints name tables the model does not have: {unknown}")
        world = self.topology.world_size
        memory = [0] * world
        cost = [0.0] * world
        chosen: Dict[str, ParameterSharding] = {}
        for t in sorted(tables, key=lambda t: (-t.num_embeddings * t.embedding_dim, t.name)):
            best = None
            for option in self._options(t, memory, cost):
                shards, kernel, st = option
                new_mem, new_cost = self._apply(t, st, shards, memory, cost)
                if max(new_mem) > self.topology.capacity:
                    continue
                key = (max(new_cost), sum(new_cost), _TYPE_ORDER.index(st))
                if best is None or key < best[0]:
                    best = (key, st, kernel, shards, new_mem, new_cost)
            if best is None:
                size = t.num_embeddings * t.embedding_dim * 4
                raise ValueError(
                    f"table {t.name!r} ({size} bytes of weights plus optimizer state) fits on no rank "
                    f"under its allowed sharding types (capacity {self.topology.capacity} bytes per rank)"
                )
            _, st, kernel, shards, memory, cost = best
            chosen[t.name] = ParameterSharding(st, kernel, sorted({s.rank for s in shards}), shards)
        return ShardingPlan(
            {p: {t.name: chosen[t.name] for t in m.embedding_bag_configs()} for p, m in collections}
        )

    def collective_plan(self, module: nn.Module, pg: Optional[dist.ProcessGroup] = None) -> ShardingPlan:
        """Plans on rank 0 and broadcasts, so every rank holds the same plan."""
        if not dist.is_initialized():
            return self.plan(module)
        box = [self.plan(module) if dist.get_rank(pg) == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0) if pg else 0, group=pg)
        return box[0]

    # -- options -----------------------------------------------------------

    def _allowed(self, t: EmbeddingBagConfig) -> List[ShardingType]:
        c = self.constraints.get(t.name)
        types = list(c.sharding_types) if c and c.sharding_types is not None else list(_DEFAULT_TYPES)
        if not types:
            raise ValueError(f"table {t.name!r}: constraints allow no sharding type")
        if c and c.compute_kernels is not None:
            kernels = set(c.compute_kernels)
            types = [st for st in types if _kernel(st) in kernels]
            if not types:
                raise ValueError(f"table {t.name!r}: no allowed sharding type can use compute kernels {c.compute_kernels}")
        if t.embedding_dim % 4 != 0:
            if types == [ShardingType.COLUMN_WISE] or (types and all(st == ShardingType.COLUMN_WISE for st in types)):
                raise ValueError(f"table {t.name!r}: column-wise sharding needs a dim divisible by 4, got {t.embedding_dim}")
            types = [st for st in types if st != ShardingType.COLUMN_WISE]
        return types

    def _options(self, t: EmbeddingBagConfig, memory: List[int], cost: List[float]):
        world = self.topology.world_size
        rows, dim = t.num_embeddings, t.embedding_dim
        c = self.constraints.get(t.name)
        for st in self._allowed(t):
            kernel = _kernel(st)
            if st == ShardingType.TABLE_WISE:
                for r in range(world):
                    yield [ShardMetadata([0, 0], [rows, dim], r)], kernel, st
            elif st == ShardingType.ROW_WISE:
                yield [ShardMetadata([o, 0], [n, dim], r) for r, o, n in row_blocks(rows, list(range(world)))], kernel, st
            elif st == ShardingType.TABLE_ROW_WISE:
                local = self.topology.local_world_size
                for h in range(self.topology.num_hosts):
                    ranks = list(range(h * local, (h + 1) * local))
                    yield [ShardMetadata([o, 0], [n, dim], r) for r, o, n in row_blocks(rows, ranks)], kernel, st
            elif st == ShardingType.COLUMN_WISE:
                n = world
                if c and c.min_partition:
                    n = min(n, max(1, dim // c.min_partition))
                blocks = column_blocks(dim, n)
                # least-loaded ranks first, ties by rank
                ranks = sorted(range(world), key=lambda r: (cost[r], memory[r], r))[: len(blocks)]
                yield [ShardMetadata([0, o], [rows, w], r) for (o, w), r in zip(blocks, ranks)], kernel, st
            else:
                yield [ShardMetadata([0, 0], [rows, dim], r) for r in range(world)], kernel, st

    def _apply(self, t, st, shards, memory, cost) -> Tuple[List[int], List[float]]:
        memory, cost = list(memory), list(cost)
        c = self.constraints.get(t.name)
        pooling = c.pooling_factor if c else 1.0
        ids_per_step = self.batch_size * self.topology.world_size * pooling
        for s in shards:
            rows, cols = s.shard_sizes
            if st == ShardingType.DATA_PARALLEL:
                memory[s.rank] += 3 * rows * cols * 4
                cost[s.rank] += self.batch_size * pooling * cols
            else:
                memory[s.rank] += (rows * cols + self.optimizer.optimizer.state_floats(rows, cols)) * 4
                cost[s.rank] += ids_per_step * cols * rows / t.num_embeddings
        return memory, cost


_TYPE_ORDER = [
    ShardingType.TABLE_WISE,
    ShardingType.ROW_WISE,
    ShardingType.COLUMN_WISE,
    ShardingType.TABLE_ROW_WISE,
    ShardingType.DATA_PARALLEL,
]


def _kernel(st: ShardingType) -> EmbeddingComputeKernel:
    return EmbeddingComputeKernel.DENSE if st == ShardingType.DATA_PARALLEL else EmbeddingComputeKernel.FUSED
