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
from torch import nn

from recship.names import EmbeddingComputeKernel, ShardingType
from recship.trainer.planner.planner import column_blocks, host_ranks, row_blocks
from recship.trainer.planner.types import ParameterSharding, ShardMetadata

ParameterShardingGenerator = Callable[..., ParameterSharding]


def _device(device_type: str, rank: int, local_size: int) -> str:
    return "cpu" if device_type == "cpu" else f"cuda:{rank % local_size}"


def _sharding(kind: ShardingType, blocks: List[Tuple[int, int, int, int, int]], device_type: str, local_size: int,
              compute_kernel: Optional[str] = None) -> ParameterSharding:
    """(rank, row offset, rows, column offset, columns) blocks as a ParameterSharding."""
    kernel = EmbeddingComputeKernel(compute_kernel) if compute_kernel is not None else (
        EmbeddingComputeKernel.DENSE if kind == ShardingType.DATA_PARALLEL else EmbeddingComputeKernel.FUSED)
    shards = [ShardMetadata([r0, c0], [n, w], rank, _device(device_type, rank, local_size)) for rank, r0, n, c0, w in blocks]
    return ParameterSharding(kind, kernel, [s.rank for s in shards], shards)


def _shape(param: Any) -> Tuple[int, int]:
    rows, dim = param.shape
    return int(rows), int(dim)


def data_parallel() -> ParameterShardingGenerator:
    """A full replica of the table on every rank (its gradients all-reduced)."""
    def generate(param: Any, local_size: int, world_size: int, device_type: str, sharder: Any = None) -> ParameterSharding:
        rows, dim = _shape(param)
        return _sharding(ShardingType.DATA_PARALLEL, [(r, 0, rows, 0, dim) for r in range(world_size)], device_type, local_size)
    return generate


def table_wise(rank: int, device: Optional[str] = None, compute_kernel: Optional[str] = None) -> ParameterShardingGenerator:
    """The whole table on ``rank`` (``device``: its device type there, default the plan's)."""
    def generate(param: Any, local_size: int, world_size: int, device_type: str, sharder: Any = None) -> ParameterSharding:
        rows, dim = _shape(param)
        if not 0 <= rank < world_size:
            raise ValueError(f"table_wise(rank={rank}): the world has ranks 0..{world_size - 1}")
        return _sharding(ShardingType.TABLE_WISE, [(rank, 0, rows, 0, dim)], device or device_type, local_size, compute_kernel)
    return generate


def row_wise(sizes_placement: Optional[Tuple[List[int], Any]] = None) -> ParameterShardingGenerator:
    """Contiguous row blocks, one a rank of the world (ceil-sized, as the planner cuts them), or the given
    ``(sizes, placement)``: ``sizes[r]`` rows on rank r, in order."""
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
        return _sharding(ShardingType.ROW_WISE, [(r, o, n, 0, dim) for r, o, n in blocks], device_type, local_size)
    return generate


def column_wise(ranks: List[int]) -> ParameterShardingGenerator:
    """Column blocks (multiples of 4 wide, as fbgemm needs), one on each of ``ranks``, in order."""
    def generate(param: Any, local_size: int, world_size: int, device_type: str, sharder: Any = None) -> ParameterSharding:
        rows, dim = _shape(param)
        if not ranks or any(not 0 <= r < world_size for r in ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(f"column_wise(ranks={ranks}): distinct ranks of a world of {world_size}")
        blocks = column_blocks(dim, len(ranks))
        return _sharding(ShardingType.COLUMN_WISE, [(r, 0, rows, o, w) for r, (o, w) in zip(ranks, blocks)], device_type,
                         local_size)
    return generate


def table_row_wise(host_index: int) -> ParameterShardingGenerator:
    """Row blocks over the ranks of host ``host_index`` (``local_size`` ranks a host)."""
    def generate(param: Any, local_size: int, world_size: int, device_type: str, sharder: Any = None) -> ParameterSharding:
        rows, dim = _shape(param)
        if not 0 <= host_index < world_size // local_size:
            raise ValueError(f"table_row_wise(host_index={host_index}): {world_size // local_size} hosts of {local_size} ranks")
        blocks = row_blocks(rows, host_ranks(host_index, local_size))
        return _sharding(ShardingType.TABLE_ROW_WISE, [(r, o, n, 0, dim) for r, o, n in blocks], device_type, local_size)
    return generate


def _tables(module: nn.Module) -> Dict[str, Any]:
    """Each table's weight (what a generator reads its shape from): an EmbeddingBagCollection's
    ``embedding_bags`` or an EmbeddingCollection's ``embeddings`` (which recship trains data-parallel only)."""
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
    return {name: parameter_sharding_generator for name in _tables(module)}


def construct_module_sharding_plan(module: nn.Module, per_param_sharding: Dict[str, ParameterShardingGenerator],
                                   sharder: Any = None, local_size: Optional[int] = None, world_size: Optional[int] = None,
                                   device_type: Optional[str] = None) -> Dict[str, ParameterSharding]:
    """``module``'s plan (table -> ParameterSharding): each table's generator called with its weight. ``world_size``
    defaults to the process group's, ``local_size`` to the world's, ``device_type`` to cuda where torch sees one."""
    import torch.distributed as dist

    tables = _tables(module)
    unknown, missing = sorted(set(per_param_sharding) - set(tables)), sorted(set(tables) - set(per_param_sharding))
    if unknown or missing:
        raise ValueError(f"per_param_sharding names tables {type(module).__name__} lacks {unknown}, or lacks its tables {missing}")
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    local_size = local_size or world_size
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return {name: per_param_sharding[name](tables[name], local_size, world_size, device_type, sharder) for name in tables}
