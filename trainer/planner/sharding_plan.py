"""TorchRec's ``torchrec.distributed.sharding_plan``: a plan written by hand, table by table.

    plan = ShardingPlan({"sparse_arch": construct_module_sharding_plan(
        model.sparse_arch, {"t_user": table_wise(rank=0), "t_item": row_wise(), "t_ad": column_wise(ranks=[0, 1])},
        local_size=2, world_size=2, device_type="cpu")})
    DistributedModelParallel(model, plan=plan)

Each helper returns a generator ``(parameter, local_size, world_size, device_type, sharder=None) -> ParameterSharding``
that ``construct_module_sharding_plan`` calls with the table's weight; ``apply_to_all`` gives one generator every table.
The shards' geometry is the planner's (``row_blocks``, ``column_blocks``, ``host_ranks``), so a hand-written plan and the
planner's plan of the same types and ranks are equal.
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from recship.names import EmbeddingComputeKernel, ShardingType
from recship.trainer.distributed.sharders import get_default_sharders
from recship.trainer.planner.planner import column_block_count, column_blocks, host_ranks, row_blocks
from recship.trainer.planner.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardMetadata, _member

ParameterShardingGenerator = Callable[..., ParameterSharding]


def _device(device_type: str, rank: int, local_size: int) -> str:
    return "cpu" if device_type == "cpu" else f"cuda:{rank % local_size}"


def _kernel(kind: ShardingType, compute_kernel: Optional[str]) -> EmbeddingComputeKernel:
    """The kernel a helper puts in its ParameterSharding: the one asked for (a kernel recship does not run is a
    ValueError naming it), else dense for data_parallel and fused for every sharded type. TorchRec's default for a
    sharded type is dense unless the table has an in-backward optimizer; recship trains sharded tables fused only."""
    if compute_kernel is not None:
        return _member(EmbeddingComputeKernel, compute_kernel, "compute kernel")
    return EmbeddingComputeKernel.DENSE if kind == ShardingType.DATA_PARALLEL else EmbeddingComputeKernel.FUSED


def _sharding(kind: ShardingType, blocks: List[Tuple[int, int, int, int, int]], device_type: str, local_size: int,
              compute_kernel: Optional[str] = None) -> ParameterSharding:
    """(rank, row offset, rows, column offset, columns) blocks as a ParameterSharding."""
    shards = [ShardMetadata([r0, c0], [n, w], rank, _device(device_type, rank, local_size)) for rank, r0, n, c0, w in blocks]
    return ParameterSharding(kind, _kernel(kind, compute_kernel), [s.rank for s in shards], shards)


def _shape(param: Any) -> Tuple[int, int]:
    rows, dim = param.shape
    return int(rows), int(dim)


def data_parallel() -> ParameterShardingGenerator:
    """A full replica of the table on every rank (its gradients all-reduced); kernel dense."""
    def generate(param: Any, local_size: int, world_size: int, device_type: str, sharder: Any = None) -> ParameterSharding:
        rows, dim = _shape(param)
        return _sharding(ShardingType.DATA_PARALLEL, [(r, 0, rows, 0, dim) for r in range(world_size)], device_type, local_size)
    return generate


def table_wise(rank: int, device: Optional[str] = None, compute_kernel: Optional[str] = None) -> ParameterShardingGenerator:
    """The whole table on ``rank`` (``device``: its device type there, default the plan's)."""
    kernel = _kernel(ShardingType.TABLE_WISE, compute_kernel)  # checked when the plan is written, not when applied

    def generate(param: Any, local_size: int, world_size: int, device_type: str, sharder: Any = None) -> ParameterSharding:
        rows, dim = _shape(param)
        if not 0 <= rank < world_size:
            raise ValueError(f"table_wise(rank={rank}): the world has ranks 0..{world_size - 1}")
        return _sharding(ShardingType.TABLE_WISE, [(rank, 0, rows, 0, dim)], device or device_type, local_size, kernel)
    return generate


def row_wise(sizes_placement: Optional[Tuple[List[int], Any]] = None, compute_kernel: Optional[str] = None,
             num_buckets: Optional[int] = None) -> ParameterShardingGenerator:
    """Contiguous row blocks, one a rank of the world (ceil-sized, as the planner cuts them), or the given
    ``(sizes, placement)``: ``sizes[r]`` rows on rank r, in order. With ``sizes_placement`` and no
    ``compute_kernel`` the kernel is quant, as in TorchRec (uneven row blocks are its inference form); recship
    also trains them when ``compute_kernel="fused"`` is given. ``num_buckets`` (TorchRec's bucketed virtual
    tables) is refused."""
    if num_buckets is not None:
        raise ValueError(f"row_wise(num_buckets={num_buckets}): bucketed row-wise shards are TorchRec's for virtual "
                         "(key-value / managed-collision) tables, which recship does not have; leave num_buckets out")
    kernel = _kernel(ShardingType.ROW_WISE, compute_kernel if compute_kernel is not None or sizes_placement is None
                     else EmbeddingComputeKernel.QUANT.value)

    def generate(param: Any, local_size: int, world_size: int, device_type: str, sharder: Any = None) -> ParameterSharding:
        rows, dim = _shape(param)
        if sizes_placement is None:
            blocks = row_blocks(rows, list(range(world_size)))
        else:
            sizes = list(sizes_placement[0])
            if len(sizes) > world_size or sum(sizes) != rows or any(n < 0 for n in sizes):
                raise ValueError(f"row_wise(sizes={sizes}): {rows} rows over at most {world_size} ranks")
            starts = [sum(sizes[:r]) for r in range(len(sizes))]
            blocks = [(r, starts[r], n) for r, n in enumerate(sizes) if n > 0]
        return _sharding(ShardingType.ROW_WISE, [(r, o, n, 0, dim) for r, o, n in blocks], device_type, local_size, kernel)
    return generate


def column_wise(ranks: Optional[List[int]] = None, size_per_rank: Optional[List[int]] = None,
                compute_kernel: Optional[str] = None, device_types: Optional[List[str]] = None) -> ParameterShardingGenerator:
    """Column blocks (multiples of 4 wide, as fbgemm needs), one on each of ``ranks``, in order; or, with
    ``size_per_rank``, block i of ``size_per_rank[i]`` columns on rank i (TorchRec's rule). ``device_types``
    (TorchRec's per-shard devices, for mixed CPU/GPU inference) is refused: recship places every shard on the
    plan's device type."""
    if device_types is not None:
        raise ValueError(f"column_wise(device_types={device_types}): recship places every shard on the plan's device "
                         "type (construct_module_sharding_plan(device_type=...)); leave device_types out")
    if (ranks is None) == (size_per_rank is None):
        raise ValueError("column_wise takes either ranks= (the ranks of even column blocks) or size_per_rank= "
                         f"(columns on rank 0, 1, ...), got ranks={ranks}, size_per_rank={size_per_rank}")
    kernel = _kernel(ShardingType.COLUMN_WISE, compute_kernel)

    def generate(param: Any, local_size: int, world_size: int, device_type: str, sharder: Any = None) -> ParameterSharding:
        rows, dim = _shape(param)
        if size_per_rank is not None:
            widths = list(size_per_rank)
            if (len(widths) > world_size or sum(widths) != dim or any(w < 0 or w % 4 for w in widths)):
                raise ValueError(f"column_wise(size_per_rank={widths}): {dim} columns in blocks of multiples of 4 over "
                                 f"at most {world_size} ranks")
            offsets = [sum(widths[:i]) for i in range(len(widths))]
            return _sharding(ShardingType.COLUMN_WISE, [(r, 0, rows, offsets[r], w) for r, w in enumerate(widths) if w],
                             device_type, local_size, kernel)
        assert ranks is not None
        if not ranks or any(not 0 <= r < world_size for r in ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(f"column_wise(ranks={ranks}): distinct ranks of a world of {world_size}")
        blocks = column_blocks(dim, len(ranks))
        return _sharding(ShardingType.COLUMN_WISE, [(r, 0, rows, o, w) for r, (o, w) in zip(ranks, blocks)], device_type,
                         local_size, kernel)
    return generate


def table_row_wise(host_index: int) -> ParameterShardingGenerator:
    """Row blocks over the ranks of host ``host_index`` (``local_size`` ranks a host); kernel fused."""
    def generate(param: Any, local_size: int, world_size: int, device_type: str, sharder: Any = None) -> ParameterSharding:
        rows, dim = _shape(param)
        if not 0 <= host_index < world_size // local_size:
            raise ValueError(f"table_row_wise(host_index={host_index}): {world_size // local_size} hosts of {local_size} ranks")
        blocks = row_blocks(rows, host_ranks(host_index, local_size))
        return _sharding(ShardingType.TABLE_ROW_WISE, [(r, o, n, 0, dim) for r, o, n in blocks], device_type, local_size)
    return generate


def grid_shard(host_indexes: List[int]) -> ParameterShardingGenerator:
    """TorchRec's grid sharding (column blocks, each row-wise over a host): recship does not shard this way."""
    ShardingType.GRID_SHARD.check_runnable()
    raise AssertionError("unreachable: check_runnable raises")


def _tables(module: nn.Module) -> Dict[str, Any]:
    """Each table's weight (what a generator reads its shape from): an EmbeddingBagCollection's
    ``embedding_bags`` or an EmbeddingCollection's ``embeddings``."""
    module = getattr(module, "_embedding_bag_collection", module)  # a FeatureProcessedEmbeddingBagCollection's tables
    bags = getattr(module, "embedding_bags", None)
    if not isinstance(bags, nn.ModuleDict):
        bags = getattr(module, "embeddings", None)
    if not isinstance(bags, nn.ModuleDict):
        raise TypeError(f"{type(module).__name__} is not an EmbeddingBagCollection or EmbeddingCollection: it has no tables")
    return {name: bag.weight for name, bag in bags.items()}


def apply_to_all(module: nn.Module, parameter_sharding_generator: ParameterShardingGenerator,
                 sharder: Any = None) -> Dict[str, ParameterShardingGenerator]:
    """The same generator for every table of ``module``."""
    _check_sharder(module, sharder)
    return {name: parameter_sharding_generator for name in _tables(module)}


def _check_sharder(module: nn.Module, sharder: Any) -> None:
    module_type = getattr(sharder, "module_type", None)
    if sharder is not None and not isinstance(module, module_type if isinstance(module_type, type) else ()):
        raise TypeError(f"sharder {sharder!r} shards {getattr(module_type, '__name__', module_type)}, not "
                        f"{type(module).__name__}")


def construct_module_sharding_plan(module: nn.Module, per_param_sharding: Dict[str, ParameterShardingGenerator],
                                   sharder: Any = None, local_size: Optional[int] = None, world_size: Optional[int] = None,
                                   device_type: Optional[str] = None) -> EmbeddingModuleShardingPlan:
    """``module``'s plan (table -> ParameterSharding, an ``EmbeddingModuleShardingPlan`` as in TorchRec): each table's
    generator called with its weight. ``world_size`` defaults to the process group's, ``local_size`` to the world's,
    ``device_type`` to cuda where torch sees one."""
    _check_sharder(module, sharder)
    tables = _tables(module)
    unknown, missing = sorted(set(per_param_sharding) - set(tables)), sorted(set(tables) - set(per_param_sharding))
    if unknown or missing:
        raise ValueError(f"per_param_sharding names tables {type(module).__name__} lacks {unknown}, or lacks its tables {missing}")
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    local_size = local_size or world_size
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return EmbeddingModuleShardingPlan(
        {name: per_param_sharding[name](tables[name], local_size, world_size, device_type, sharder) for name in tables})


def get_sharding_constructor_from_type(sharding_type: ShardingType) -> Callable[..., ParameterShardingGenerator]:
    """The helper that builds ``sharding_type``'s generator (``table_wise``, ``row_wise``, ...)."""
    helpers: Dict[ShardingType, Callable[..., ParameterShardingGenerator]] = {
        ShardingType.TABLE_WISE: table_wise, ShardingType.ROW_WISE: row_wise, ShardingType.COLUMN_WISE: column_wise,
        ShardingType.TABLE_ROW_WISE: table_row_wise, ShardingType.GRID_SHARD: grid_shard,
        ShardingType.DATA_PARALLEL: data_parallel}
    kind = _member(ShardingType, sharding_type, "sharding type") if not isinstance(sharding_type, ShardingType) else sharding_type
    if kind not in helpers:
        raise ValueError(f"no sharding helper for {kind.value!r}: recship has {[k.value for k in helpers]}")
    return helpers[kind]


def get_module_to_default_sharders() -> Dict[type, Any]:
    """Module type -> its default sharder (``get_default_sharders()`` keyed by ``module_type``)."""
    return {sharder.module_type: sharder for sharder in get_default_sharders()}


def placement(compute_device: str, rank: int, local_size: int) -> str:
    """A shard's placement string: ``rank:<r>/cpu``, or ``rank:<r>/cuda:<r % local_size>``."""
    device = compute_device if compute_device not in ("cuda", "mtia") else f"{compute_device}:{rank % local_size}"
    return f"rank:{rank}/{device}"


def placement_helper(device_type: str, index: int = 0, rank: int = 0) -> str:
    """TorchRec's placement of an inference shard: ``rank:0/cpu`` on the CPU, else ``rank:<rank>/<type>:<index>``."""
    return f"rank:0/{device_type}" if device_type == "cpu" else f"rank:{rank}/{device_type}:{index}"


def calculate_shard_sizes_and_offsets(tensor: torch.Tensor, world_size: int, local_world_size: int, sharding_type: str,
                                      col_wise_shard_dim: Optional[int] = None,
                                      device_memory_sizes: Optional[List[int]] = None,
                                      num_buckets: Optional[int] = None) -> Tuple[List[List[int]], List[List[int]]]:
    """The [rows, columns] sizes and [row, column] offsets of ``tensor``'s shards under ``sharding_type``, in the
    geometry recship's planner and helpers use (module docstring): what their plans hold.

    Where TorchRec's geometry differs: a row split leaves out ranks whose block would be empty (TorchRec lists them
    with 0 rows), and column blocks follow ``column_block_count`` / ``column_blocks`` (``col_wise_shard_dim`` is the
    smallest block width). Uneven rows by ``device_memory_sizes`` and ZCH buckets (``num_buckets``) are refused.
    """
    rows, columns = int(tensor.shape[0]), int(tensor.shape[1])
    kind = _member(ShardingType, sharding_type, "sharding type")
    if device_memory_sizes is not None or num_buckets is not None:
        raise ValueError("calculate_shard_sizes_and_offsets: recship splits rows evenly (ceil), without per-device "
                         "memory sizes or ZCH buckets; leave device_memory_sizes and num_buckets None")
    if kind == ShardingType.DATA_PARALLEL:
        return [[rows, columns] for _ in range(world_size)], [[0, 0] for _ in range(world_size)]
    if kind == ShardingType.TABLE_WISE:
        return [[rows, columns]], [[0, 0]]
    if kind in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        ranks = list(range(world_size if kind == ShardingType.ROW_WISE else local_world_size))
        blocks = row_blocks(rows, ranks)
        return [[n, columns] for _, _, n in blocks], [[r0, 0] for _, r0, _ in blocks]
    if kind == ShardingType.COLUMN_WISE:
        widths = column_blocks(columns, column_block_count(columns, world_size, col_wise_shard_dim))
        return [[rows, w] for _, w in widths], [[0, c0] for c0, _ in widths]
    raise ValueError(f"calculate_shard_sizes_and_offsets: recship does not shard {kind.value!r}")
