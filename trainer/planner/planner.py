"""EmbeddingShardingPlanner: choose how every table of every EmbeddingBagCollection is sharded.

Shard geometry (the sharded modules, for training and for inference, rely on exactly
these rules; see the pure functions ``row_blocks``, ``host_ranks``, ``column_block_count``
and ``column_blocks``, and ``bucketize_rows`` and ``merge_blocks`` for lookups over shards):

- ROW_WISE: block = ceil(rows / world_size); rank r holds rows [r * block, (r + 1) * block)
  clipped to the table; ranks whose block is empty hold no shard.
- TABLE_ROW_WISE: the table goes to one host (host h = ranks h * L .. h * L + L - 1 for
  L = local_world_size); its rows are split over that host's ranks as for ROW_WISE.
- COLUMN_WISE: n = min(world_size, dim // 4, dim // min_partition) blocks whose widths are
  multiples of 4, as even as possible, wider blocks first; each block on a distinct rank.
- TABLE_WISE: the whole table on one rank. DATA_PARALLEL: a full replica on every rank.

Shards are listed in row (or column) order and ``ParameterSharding.ranks[i]`` is the rank
of ``shards[i]``. DATA_PARALLEL tables use the DENSE kernel, every other type FUSED.

Memory per rank: fp32 weights plus the fused optimizer's state for every shard it holds
(``shard_bytes``). Cost per rank: floats it reads and sends per step (``shard_cost``).
Tables are placed greedily, largest first; each gets the feasible option that keeps the
busiest rank least busy. The planner is deterministic: ties go to the earlier option in a
fixed order (sharding type order below, then lower ranks).

That placement runs once per proposal (``components``: the proposers say which types each
table may take, a storage reservation first takes its share of every rank); the plan whose
busiest rank is least busy wins. EmbeddingCollection tables take TorchRec's types for them (no table-row-wise).
"""

import logging
import math
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union, cast

import torch
import torch.distributed as dist
from torch import nn

from recship.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.fused_embedding_modules import FusedEmbeddingBagCollection
from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
from recship.trainer.managed_collisions.embedding import managed_collision_plan_path
from recship.trainer.planner.components import (EmbeddingEnumerator, GreedyPerfPartitioner, PlannerError, PlannerErrorType,
                                               Proposer, ShardingPlanner, StorageReservation, proposers_of)
from recship.trainer.planner.types import (EmbeddingComputeKernel, EmbeddingModuleShardingPlan, ParameterConstraints,
                                          ParameterSharding, ShardingPlan, ShardingType, ShardMetadata, Topology)

_log = logging.getLogger(__name__)

FLOAT_BYTES = 4  # the planner counts every weight and optimizer state as fp32

# Candidates when a table has no sharding_types constraint; data-parallel must be asked for.
DEFAULT_SHARDING_TYPES = [
    ShardingType.TABLE_WISE,
    ShardingType.ROW_WISE,
    ShardingType.COLUMN_WISE,
    ShardingType.TABLE_ROW_WISE,
]
# Tie-break order between options of equal cost.
_TYPE_ORDER = DEFAULT_SHARDING_TYPES + [ShardingType.DATA_PARALLEL]


# -- shard geometry (pure) ---------------------------------------------------


def row_blocks(rows: int, ranks: List[int]) -> List[Tuple[int, int, int]]:
    """[(rank, row offset, rows)] of a row split of ``rows`` over ``ranks``, in rank-list order.

    Every rank gets ceil(rows / len(ranks)) rows except the last non-empty one; ranks
    whose block would start past the table get nothing and are left out.
    Example: 10 rows over ranks [0, 1, 2] -> [(0, 0, 4), (1, 4, 4), (2, 8, 2)].
    """
    if rows < 1 or not ranks:
        raise ValueError(f"row_blocks needs rows >= 1 and at least one rank, got {rows} rows, ranks {ranks}")
    block = math.ceil(rows / len(ranks))
    return [(r, i * block, min(rows, (i + 1) * block) - i * block) for i, r in enumerate(ranks) if i * block < rows]


def host_ranks(host: int, local_world_size: int) -> List[int]:
    """The ranks of ``host``: host * L .. host * L + L - 1 (L = local_world_size)."""
    return list(range(host * local_world_size, (host + 1) * local_world_size))


def column_block_count(dim: int, world_size: int, min_partition: Optional[int] = None) -> int:
    """How many column blocks a column-wise table gets: min(world_size, dim // 4, dim // min_partition).

    Never less than 1 (a min_partition wider than the table leaves one full-width block).
    """
    if dim % 4 != 0:
        raise ValueError(f"column-wise sharding needs a dim divisible by 4, got {dim}")
    n = min(world_size, dim // 4)
    if min_partition is not None:
        n = min(n, dim // min_partition)
    return max(1, n)


def column_blocks(dim: int, n: int) -> List[Tuple[int, int]]:
    """[(column offset, width)] of ``n`` blocks tiling ``dim`` columns.

    Widths are multiples of 4 (fbgemm's row alignment), as even as possible, wider
    blocks first. Examples: (64, 2) -> 32, 32; (64, 3) -> 24, 20, 20.
    """
    if dim % 4 != 0:
        raise ValueError(f"column-wise sharding needs a dim divisible by 4, got {dim}")
    units = dim // 4
    if not 1 <= n <= units:
        raise ValueError(f"cannot split {dim} columns into {n} blocks of multiples of 4")
    widths = [4 * (units // n + (1 if i < units % n else 0)) for i in range(n)]
    offsets = [sum(widths[:i]) for i in range(n)]
    return list(zip(offsets, widths))


# -- lookups over shards (TorchScript-able: the inference sharded module scripts them) --


def bucketize_rows(
    ids: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor], row_offset: int, rows: int
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """One feature's lookups that fall in row block [row_offset, row_offset + rows), rebased to it.

    Args:
        ids: [N] int64 ids of the whole table, examples one after another.
        lengths: [B] int64 ids per example.
        weights: [N] float per-id weights, or None.

    Returns (ids [M] rebased to the block, lengths [B] int64 of the block's ids per
    example, weights [M] or None), in the input's order.
    """
    inside = (ids >= row_offset) & (ids < row_offset + rows)
    example = torch.repeat_interleave(torch.arange(lengths.numel(), device=ids.device), lengths)
    counts = torch.zeros_like(lengths).index_add_(0, example, inside.to(torch.int64))
    return ids[inside] - row_offset, counts, None if weights is None else weights[inside]


def merge_blocks(blocks: List[Tuple[int, torch.Tensor]]) -> torch.Tensor:
    """One feature's pooled output [B, dim] from its shards' outputs [(column offset, [B, width])].

    Outputs at the same column offset (row blocks' partial sums) are added in list order;
    column blocks are then concatenated by offset. MEAN pooling divides afterwards.
    """
    by_col: Dict[int, torch.Tensor] = {}
    for col, block in blocks:
        if col in by_col:
            by_col[col] = by_col[col] + block
        else:
            by_col[col] = block
    offsets = sorted(by_col.keys())
    if len(offsets) == 1:
        return by_col[offsets[0]]
    return torch.cat([by_col[c] for c in offsets], dim=1)


# -- memory and cost (pure) --------------------------------------------------


def shard_bytes(rows: int, cols: int, sharding_type: ShardingType, optimizer: EmbOptimType) -> int:
    """Bytes one [rows, cols] shard takes on its rank.

    Fused shards: fp32 weights plus the fused optimizer's state (row-wise adagrad: one
    float per row). Data-parallel replicas train with a dense optimizer: weights, a
    full-size gradient and a full-size adagrad-like state, 3 * rows * cols floats.
    """
    if sharding_type == ShardingType.DATA_PARALLEL:
        return 3 * rows * cols * FLOAT_BYTES
    return (rows * cols + optimizer.state_floats(rows, cols)) * FLOAT_BYTES


def shard_cost(
    shard_rows: int,
    shard_cols: int,
    table_rows: int,
    sharding_type: ShardingType,
    batch_size: int,
    world_size: int,
    pooling_factor: float,
    num_features: float,
    pooled: bool = True,
) -> float:
    """Floats one shard reads and sends per step on its rank (a relative cost, not seconds).

    Sharded types see the global batch: lookups = ids of the global batch that fall in
    the shard's rows (ids assumed uniform over the table) x shard_cols; communication =
    the pooled [global batch, shard_cols] output per feature it sends back. Data-parallel
    replicas look up only the local batch, then all-reduce a dense gradient (~2 x table).
    ``pooled=False`` (an EmbeddingCollection's table): a shard sends one row per id instead of one per bag.
    """
    ids_per_example = pooling_factor * num_features
    if sharding_type == ShardingType.DATA_PARALLEL:
        return batch_size * ids_per_example * shard_cols + 2.0 * shard_rows * shard_cols
    global_batch = batch_size * world_size
    lookups = global_batch * ids_per_example * (shard_rows / table_rows) * shard_cols
    if not pooled:  # an EmbeddingCollection's shard sends back one row per id it looked up
        return 2.0 * lookups
    return lookups + global_batch * num_features * shard_cols


def _default_topology() -> Topology:
    """TorchRec's default: the process group's world, on CUDA when there is one."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return Topology(world_size=world, compute_device="cuda" if torch.cuda.is_available() else "cpu")


def _configs(m: nn.Module) -> List[Any]:
    """A collection's table configs (EmbeddingBagConfig or EmbeddingConfig)."""
    if isinstance(m, (EmbeddingBagCollection, FusedEmbeddingBagCollection)):
        return list(m.embedding_bag_configs())
    assert isinstance(m, EmbeddingCollection), type(m)
    return list(m.embedding_configs())


def _load(c: ParameterConstraints, t: Any, batch_size: int) -> Tuple[float, float]:
    """(pooling factor, features) for ``shard_cost``: ``c.pooling_factor`` and the table's feature count, or, where
    the constraints list ``pooling_factors`` / ``num_poolings`` / ``batch_sizes`` per feature, the equivalent pair:
    batch_size x features = pooled outputs a step, batch_size x pooling factor x features = ids a step."""
    if c.pooling_factors is None and c.num_poolings is None and c.batch_sizes is None:
        return c.pooling_factor, t.num_features()
    loads = c.feature_loads(list(t.feature_names), batch_size)
    ids, outputs = sum(i for i, _ in loads), sum(o for _, o in loads)
    return ids / outputs, outputs / batch_size


def _kernel(sharding_type: ShardingType) -> EmbeddingComputeKernel:
    if sharding_type == ShardingType.DATA_PARALLEL:
        return EmbeddingComputeKernel.DENSE
    return EmbeddingComputeKernel.FUSED


# -- the planner ---------------------------------------------------------------


class EmbeddingShardingPlanner(ShardingPlanner):
    """Plans every EmbeddingBagCollection (and EmbeddingCollection) of a module for ``topology``.

    TorchRec's arguments, in TorchRec's order (``recship.trainer.planner.components`` says
    what each part does here):

    Args:
        topology: ranks, device and memory per rank (default: the initialised process
            group's world on CUDA if available, else one CPU rank).
        batch_size: examples per rank per step, for the cost estimate (default 512).
        enumerator: an EmbeddingEnumerator; its constraints are the planner's.
        storage_reservation: memory kept free on every rank (e.g.
            HeuristicalStorageReservation(percentage=0.15)); default none.
        proposer: a proposer or a list of them (default GreedyProposer()).
        partitioner: None or GreedyPerfPartitioner() (TorchRec's default, which is recship's placement);
            another is refused.
        performance_model, stats: TorchRec's replaceable parts; recship's cost model and plan
            printout are fixed, so these must be None.
        constraints: table name -> ParameterConstraints (applies to every collection
            holding a table of that name).
        debug: log each plan (``str(plan)``, TorchRec's stats table's place) at DEBUG.
        callbacks, plan_loader: TorchRec's hooks into its ShardingOptions and plan storage: refused
            (recship: ParameterConstraints, ShardingPlan.load).
        timeout_seconds: stop trying further proposals once planning has taken this long (the best
            plan so far wins), as TorchRec's search does.
        optimizer: recship's: the fused optimizer whose state counts against memory
            (default: the sharders' ``fused_params`` optimizer, else EXACT_ROWWISE_ADAGRAD).
    """

    def __init__(
        self,
        topology: Optional[Topology] = None,
        batch_size: Optional[int] = None,
        enumerator: Optional[EmbeddingEnumerator] = None,
        storage_reservation: Optional[StorageReservation] = None,
        proposer: Union[None, Proposer, List[Proposer]] = None,
        partitioner: Any = None,
        performance_model: Any = None,
        stats: Any = None,
        constraints: Optional[Dict[str, ParameterConstraints]] = None,
        debug: bool = True,
        callbacks: Optional[List[Any]] = None,
        timeout_seconds: Optional[int] = None,
        plan_loader: Any = None,
        *,
        optimizer: Optional[FusedOptimizerConfig] = None,
    ) -> None:
        if callbacks:
            raise ValueError(f"EmbeddingShardingPlanner(callbacks={callbacks!r}): TorchRec's callbacks rewrite its "
                             "ShardingOptions, which recship's planner does not have; constrain tables with "
                             "ParameterConstraints instead")
        if plan_loader is not None:
            raise ValueError(f"EmbeddingShardingPlanner(plan_loader={plan_loader!r}): recship loads a stored plan with "
                             "ShardingPlan.load(path) and passes it to DistributedModelParallel(plan=...)")
        if timeout_seconds is not None and not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0 or None, got {timeout_seconds!r}")
        self.timeout_seconds = timeout_seconds
        if isinstance(topology, dict) or isinstance(batch_size, dict):
            raise TypeError("EmbeddingShardingPlanner's second argument is batch_size (TorchRec's order): "
                            "pass constraints=... by keyword")
        if batch_size is None:
            batch_size = enumerator.batch_size if enumerator is not None else 512
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if isinstance(partitioner, GreedyPerfPartitioner):  # recship's placement (checked at its construction)
            partitioner = None
        for name, given in (("partitioner", partitioner), ("performance_model", performance_model), ("stats", stats)):
            if given is not None and given != []:
                raise ValueError(
                    f"EmbeddingShardingPlanner({name}={given!r}): recship's placement (largest table first, on the least "
                    f"busy rank), cost model (shard_cost) and plan printout (print(plan)) are fixed; leave {name} out"
                )
        if enumerator is not None and not isinstance(enumerator, EmbeddingEnumerator):
            raise TypeError(f"enumerator must be recship's EmbeddingEnumerator (its enumeration is the planner's own), "
                            f"got {type(enumerator).__name__}")
        if storage_reservation is not None and not isinstance(storage_reservation, StorageReservation):
            raise TypeError(f"storage_reservation must be recship's HeuristicalStorageReservation or "
                            f"FixedPercentageStorageReservation, got {type(storage_reservation).__name__}")
        self.topology = topology or (enumerator.topology if enumerator is not None else _default_topology())
        self.constraints = dict(constraints or {})
        if enumerator is not None:
            if enumerator.topology != self.topology or enumerator.batch_size != batch_size:
                raise ValueError(
                    f"the enumerator's topology and batch_size ({enumerator.topology}, {enumerator.batch_size}) differ "
                    f"from the planner's ({self.topology}, {batch_size}): recship plans with one of each"
                )
            if constraints is not None and enumerator.constraints and enumerator.constraints != self.constraints:
                raise ValueError("the planner's and the enumerator's constraints differ: give them once")
            self.constraints = dict(enumerator.constraints or self.constraints)
        self._optimizer = optimizer
        self.batch_size = batch_size
        self.storage_reservation = storage_reservation
        self.proposers = proposers_of(proposer)
        self.debug = debug

    @property
    def optimizer(self) -> FusedOptimizerConfig:
        return self._optimizer or FusedOptimizerConfig()

    def plan(self, module: nn.Module, sharders: Optional[Sequence[Any]] = None) -> ShardingPlan:
        """A plan for every EmbeddingBagCollection in ``module`` (path "" for the module itself).

        ``sharders`` (TorchRec's argument): the sharders that will shard the module; their
        EmbeddingBagCollection sharder's ``fused_params`` optimizer is the one whose state the
        plan makes room for, unless the planner was given one. Collections without a sharder
        among them are not planned (default: EmbeddingBagCollections only).
        EmbeddingCollections (with an EmbeddingCollectionSharder) are planned like EmbeddingBagCollections,
        without table-row-wise (TorchRec's EmbeddingCollectionSharder has none) and with unpooled output costs.

        Raises PlannerError (a ValueError) naming the table for bad constraints or a table
        that fits nowhere, after the storage reservation.
        """
        optim = self.optimizer.optimizer
        kinds: Tuple[type, ...] = (EmbeddingBagCollection,)
        if sharders is not None:
            sharders = with_ebc_sharders(sharders)  # an FP-EBC's sharder plans its EmbeddingBagCollection
            ebc_sharders = [s for s in sharders if getattr(s, "module_type", None) is EmbeddingBagCollection]
            kinds = tuple(k for k in (EmbeddingBagCollection, EmbeddingCollection, FusedEmbeddingBagCollection)
                          if any(getattr(s, "module_type", None) is k for s in sharders))
            if self._optimizer is None and ebc_sharders and getattr(ebc_sharders[0], "fused_params", None):
                optim = ebc_sharders[0].optimizer_config().optimizer
        collections = [(p, m) for p, m in module.named_modules() if type(m) in kinds]
        if not collections:
            return ShardingPlan({})
        tables = [(p, t) for p, m in collections for t in _configs(m)]
        unknown = sorted(set(self.constraints) - {t.name for _, t in tables})
        if unknown:
            raise PlannerError(f"constraints name tables the model does not have: {unknown}",
                               PlannerErrorType.STRICT_CONSTRAINTS)
        # all constraint errors before placing
        allowed = [self._allowed_types(t, isinstance(m, EmbeddingCollection))
                   for p, m in collections for t in _configs(m)]
        allowed = [_row_wise_if_managed(module, p, t, types) for (p, t), types in zip(tables, allowed)]
        reserved = 0
        if self.storage_reservation is not None:
            reserved = self.storage_reservation.reserve(self.topology, self.batch_size, module,
                                                        [m for _, m in collections], self.constraints)
        best: Optional[Tuple[Tuple[float, float, int], Dict[Tuple[str, str], ParameterSharding]]] = None
        first_error: Optional[PlannerError] = None
        started = time.monotonic()
        for proposer in self.proposers:
            for proposal in proposer.proposals(allowed):
                if self.timeout_seconds is not None and best is not None and time.monotonic() - started > self.timeout_seconds:
                    break
                try:
                    chosen, memory, cost = self._place_all(tables, proposal, optim, reserved)
                except PlannerError as e:
                    first_error = first_error or e
                    continue
                key = (max(cost), sum(cost), max(memory))
                if best is None or key < best[0]:
                    best = (key, chosen)
        if best is None:
            if first_error is not None:
                raise first_error
            raise PlannerError(f"no proposer proposed a plan ({self.proposers}): grid search stops above max_proposals, "
                               "uniform needs one sharding type every table allows", PlannerErrorType.OTHER)
        chosen = best[1]
        for (_, name), sharding in chosen.items():
            for shard in sharding.shards:
                shard.device = self._device_of(shard.rank)
            c = self.constraints.get(name)
            if c is not None:  # TorchRec copies these into the table's ParameterSharding
                sharding.stochastic_rounding = c.stochastic_rounding
                sharding.bounds_check_mode = c.bounds_check_mode
                sharding.output_dtype = c.output_dtype
        plan = ShardingPlan({p: EmbeddingModuleShardingPlan({t.name: chosen[(p, t.name)] for t in _configs(m)})
                             for p, m in collections})
        if self.debug:
            _log.debug("sharding plan:\n%s", plan)
        return plan

    def _place_all(
        self, tables: List[Tuple[str, Any]], proposal: List[List[ShardingType]], optim: EmbOptimType, reserved: int
    ) -> Tuple[Dict[Tuple[str, str], ParameterSharding], List[int], List[float]]:
        """Places every table under ``proposal`` (its allowed types each), largest first, then model order."""
        memory = [reserved] * self.topology.world_size
        cost = [0.0] * self.topology.world_size
        chosen: Dict[Tuple[str, str], ParameterSharding] = {}
        sizes = [t.num_embeddings * t.embedding_dim for _, t in tables]
        for i in sorted(range(len(tables)), key=lambda i: (-sizes[i], i)):
            path, t = tables[i]
            chosen[(path, t.name)], memory, cost = self._place(t, proposal[i], optim, memory, cost, reserved)
        return chosen, memory, cost

    def collective_plan(
        self, module: nn.Module, sharders: Optional[Sequence[Any]] = None, pg: Optional[dist.ProcessGroup] = None
    ) -> ShardingPlan:
        """Plans on the group's first rank and broadcasts, so every rank holds the same plan.

        Without an initialised process group it just plans. A planning error on the
        first rank is broadcast too and raised on every rank (no rank waits forever).
        """
        if not (dist.is_available() and dist.is_initialized()):
            return self.plan(module, sharders)
        src = dist.get_global_rank(pg, 0) if pg is not None else 0
        box: List[object] = [None]
        if dist.get_rank() == src:
            try:
                box[0] = self.plan(module, sharders)
            except Exception as e:  # re-raised below after the other ranks have it
                box[0] = e
        dist.broadcast_object_list(box, src=src, group=pg)
        if isinstance(box[0], BaseException):
            raise box[0]
        assert isinstance(box[0], ShardingPlan)
        return box[0]

    # -- constraints ---------------------------------------------------------

    def _allowed_types(self, t: Any, unpooled: bool = False) -> List[ShardingType]:
        """The sharding types ``t`` may use, or PlannerError naming it when none can work.

        ``unpooled``: ``t`` is an EmbeddingCollection's table (no table-row-wise; its lookups send rows, not sums).
        """
        c = self.constraints.get(t.name) or ParameterConstraints()
        # ParameterConstraints turned value strings into members
        types = list(DEFAULT_SHARDING_TYPES if c.sharding_types is None else cast(List[ShardingType], c.sharding_types))
        if not types:
            raise PlannerError(f"table {t.name!r}: constraints allow no sharding type", PlannerErrorType.STRICT_CONSTRAINTS)
        if unpooled:  # TorchRec's EmbeddingCollectionSharder has no table-row-wise sharding
            if c.sharding_types is None:
                types = [st for st in types if st != ShardingType.TABLE_ROW_WISE]
            elif ShardingType.TABLE_ROW_WISE in types:
                raise PlannerError(
                    f"table {t.name!r} of an EmbeddingCollection: constraints ask for {[st.value for st in types]}, but "
                    "EmbeddingCollection tables shard table_wise, row_wise, column_wise or data_parallel (TorchRec's "
                    "EmbeddingCollectionSharder has no table_row_wise)",
                    PlannerErrorType.STRICT_CONSTRAINTS,
                )
        if c.pooling_factor <= 0:
            raise PlannerError(f"table {t.name!r}: pooling_factor must be > 0, got {c.pooling_factor}", PlannerErrorType.STRICT_CONSTRAINTS)
        if c.min_partition is not None and c.min_partition < 1:
            raise PlannerError(f"table {t.name!r}: min_partition must be >= 1, got {c.min_partition}", PlannerErrorType.STRICT_CONSTRAINTS)
        if c.device_group is not None and c.device_group != self.topology.compute_device:
            raise PlannerError(f"table {t.name!r}: device_group {c.device_group!r} is not the topology's compute device "
                               f"{self.topology.compute_device!r}: recship plans every table on one device kind",
                               PlannerErrorType.STRICT_CONSTRAINTS)
        try:
            c.feature_loads(list(t.feature_names), self.batch_size)
        except ValueError as e:
            raise PlannerError(f"table {t.name!r}: {e}", PlannerErrorType.STRICT_CONSTRAINTS) from None
        if c.compute_kernels is not None:
            allowed = cast(List[EmbeddingComputeKernel], c.compute_kernels)
            kernels = [k.value for k in allowed]
            if (c.sharding_types is None and not unpooled and EmbeddingComputeKernel.DENSE in allowed
                    and EmbeddingComputeKernel.FUSED not in allowed):
                types = [ShardingType.DATA_PARALLEL]  # TorchRec: the dense kernel alone plans the table data-parallel
            types = [st for st in types if _kernel(st) in allowed]
            if not types:
                raise PlannerError(
                    f"table {t.name!r}: compute kernels {kernels} fit none of its sharding types "
                    "(dense is for data_parallel only, fused for every other type)", PlannerErrorType.STRICT_CONSTRAINTS
                )
        if t.embedding_dim % 4 != 0 and ShardingType.COLUMN_WISE in types:
            types.remove(ShardingType.COLUMN_WISE)
            if not types:
                raise PlannerError(
                    f"table {t.name!r}: column-wise sharding needs a dim divisible by 4, got {t.embedding_dim}",
                    PlannerErrorType.STRICT_CONSTRAINTS,
                )
        return types

    # -- placement -----------------------------------------------------------

    def _device_of(self, rank: int) -> str:
        if self.topology.compute_device == "cuda":
            return f"cuda:{rank % self.topology.ranks_per_host}"
        return "cpu"

    def _place(
        self, t: EmbeddingBagConfig, types: List[ShardingType], optim: EmbOptimType, memory: List[int], cost: List[float],
        reserved: int = 0,
    ) -> Tuple[ParameterSharding, List[int], List[float]]:
        """The best feasible option for ``t`` and the per-rank memory and cost after it."""
        best = None
        for st in types:
            for shards in self._options(t, st, optim, memory, cost):
                new_memory, new_cost = self._add(t, st, shards, optim, memory, cost)
                if max(new_memory) > self.topology.capacity:
                    continue
                key = (max(new_cost), sum(new_cost), max(new_memory), _TYPE_ORDER.index(st))
                if best is None or key < best[0]:
                    sharding = ParameterSharding(st, _kernel(st), [s.rank for s in shards], shards)
                    best = (key, sharding, new_memory, new_cost)
        if best is None:
            need = min(shard_bytes(t.num_embeddings, t.embedding_dim, st, optim) for st in types)
            held = f", {reserved} of them reserved by {type(self.storage_reservation).__name__}" if reserved else ""
            raise PlannerError(
                f"table {t.name!r} ({need} bytes with its {optim.name} state) fits on no rank under sharding "
                f"types {[st.value for st in types]}: capacity {self.topology.capacity} bytes per rank, "
                f"already used by the tables placed before it (largest first){held}: {memory}",
                PlannerErrorType.INSUFFICIENT_STORAGE,
            )
        return best[1], best[2], best[3]

    def _options(
        self, t: EmbeddingBagConfig, st: ShardingType, optim: EmbOptimType, memory: List[int], cost: List[float]
    ) -> Iterator[List[ShardMetadata]]:
        """Every placement the planner tries for ``t`` as ``st`` (shard lists, fixed order)."""
        rows, dim, world = t.num_embeddings, t.embedding_dim, self.topology.world_size
        if st == ShardingType.TABLE_WISE:
            for r in range(world):
                yield [ShardMetadata([0, 0], [rows, dim], r)]
        elif st == ShardingType.ROW_WISE:
            yield [ShardMetadata([o, 0], [n, dim], r) for r, o, n in row_blocks(rows, list(range(world)))]
        elif st == ShardingType.TABLE_ROW_WISE:
            for h in range(self.topology.num_hosts):
                ranks = host_ranks(h, self.topology.ranks_per_host)
                yield [ShardMetadata([o, 0], [n, dim], r) for r, o, n in row_blocks(rows, ranks)]
        elif st == ShardingType.COLUMN_WISE:
            shards = self._column_shards(t, optim, memory, cost)
            if shards is not None:
                yield shards
        elif st == ShardingType.DATA_PARALLEL:
            yield [ShardMetadata([0, 0], [rows, dim], r) for r in range(world)]
        else:
            raise AssertionError(f"unhandled sharding type {st}")

    def _column_shards(
        self, t: EmbeddingBagConfig, optim: EmbOptimType, memory: List[int], cost: List[float]
    ) -> Optional[List[ShardMetadata]]:
        """Column blocks on distinct ranks, widest block on the least busy rank that can hold it.

        None when there are fewer ranks with room than blocks.
        """
        c = self.constraints.get(t.name) or ParameterConstraints()
        rows, dim = t.num_embeddings, t.embedding_dim
        blocks = column_blocks(dim, column_block_count(dim, self.topology.world_size, c.min_partition))
        free = sorted(range(self.topology.world_size), key=lambda r: (cost[r], memory[r], r))
        shards = []
        for offset, width in blocks:
            need = shard_bytes(rows, width, ShardingType.COLUMN_WISE, optim)
            fits = [r for r in free if memory[r] + need <= self.topology.capacity]
            if not fits:
                return None
            free.remove(fits[0])
            shards.append(ShardMetadata([0, offset], [rows, width], fits[0]))
        return shards

    def _add(
        self,
        t: EmbeddingBagConfig,
        st: ShardingType,
        shards: List[ShardMetadata],
        optim: EmbOptimType,
        memory: List[int],
        cost: List[float],
    ) -> Tuple[List[int], List[float]]:
        """Per-rank memory and cost after adding ``shards`` (the inputs are not changed)."""
        c = self.constraints.get(t.name) or ParameterConstraints()
        memory, cost = list(memory), list(cost)
        world = self.topology.world_size
        pooling_factor, num_features = _load(c, t, self.batch_size)
        for s in shards:
            rows, cols = s.shard_sizes
            memory[s.rank] += shard_bytes(rows, cols, st, optim)
            cost[s.rank] += shard_cost(rows, cols, t.num_embeddings, st, self.batch_size, world, pooling_factor, num_features,
                                       pooled=not isinstance(t, EmbeddingConfig))
        return memory, cost


def _row_wise_if_managed(module: nn.Module, path: str, t: Any, types: List[ShardingType]) -> List[ShardingType]:
    """``types``, or row-wise alone for a table behind a managed-collision collection (TorchRec's managed-collision
    sharders shard row-wise only: each rank remaps the ids of its input block into its rows)."""
    if managed_collision_plan_path(module, path) is None:
        return types
    if ShardingType.ROW_WISE not in types:
        raise PlannerError(f"table {t.name!r} has a managed-collision module: it shards row_wise only, its constraints "
                           f"allow {[st.value for st in types]}", PlannerErrorType.STRICT_CONSTRAINTS)
    return [ShardingType.ROW_WISE]


def with_ebc_sharders(sharders: Sequence[Any]) -> List[Any]:
    """``sharders`` plus, when none of them shards EmbeddingBagCollection, the EBC sharder of a
    FeatureProcessedEmbeddingBagCollectionSharder among them (its ``ebc_sharder``): the planner plans, and
    DistributedModelParallel shards, the FP-EBC's inner collection with it."""
    out = list(sharders)
    if not any(getattr(s, "module_type", None) is EmbeddingBagCollection for s in out):
        out += [s.ebc_sharder for s in out if getattr(s, "ebc_sharder", None) is not None][:1]
    return out
