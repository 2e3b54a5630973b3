"""Sharding vocabulary: how each table is split across ranks, and what a device can hold.

A ``ShardingPlan`` maps module path -> table name -> ``ParameterSharding``; each
``ParameterSharding`` lists its shards as ``ShardMetadata`` (row/column offsets
and sizes of the shard inside the full table, and the rank holding it). Plans
print as a readable table and round-trip through JSON, so a production job can
reuse a static plan.
"""

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Optional, Type, TypeVar, Union

from recship.names import DEVICES, EmbeddingComputeKernel, ShardingType
from recship.trainer.text import text_table


E = TypeVar("E", bound=Enum)


@dataclass
class ShardMetadata:
    """One shard: rows [r, r + rows) and columns [c, c + cols) of the table, on ``rank``'s ``device``."""

    shard_offsets: List[int]  # [row offset, column offset]
    shard_sizes: List[int]  # [rows, columns]
    rank: int
    device: str = "cpu"  # "cpu" or "cuda:<local rank>"

    @property
    def placement(self) -> str:
        return f"rank:{self.rank}/{self.device}"


@dataclass
class ParameterSharding:
    """The plan for one table."""

    sharding_type: ShardingType
    compute_kernel: EmbeddingComputeKernel
    ranks: List[int]
    shards: List[ShardMetadata] = field(default_factory=list)

    @property
    def sharding_spec(self) -> Optional[Any]:
        """TorchRec's view of ``shards``: torch's ``EnumerableShardingSpec`` of ``ShardMetadata``
        (offsets, sizes, placement "rank:<r>/<device>"), or None for data-parallel replicas.

        Read-only here: recship's ``shards`` are the plan (TorchRec's constructor argument
        ``sharding_spec`` is not taken).
        """
        if self.sharding_type == ShardingType.DATA_PARALLEL:
            return None
        from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
        from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

        return EnumerableShardingSpec([
            TorchShardMetadata(shard_offsets=list(s.shard_offsets), shard_sizes=list(s.shard_sizes), placement=s.placement)
            for s in self.shards
        ])


@dataclass
class ParameterConstraints:
    """What the planner may do with one table (all optional).

    Args:
        sharding_types: the allowed sharding types (default: all but data_parallel,
            which replicates the table and must be asked for).
        compute_kernels: the allowed kernels (default: all).
        pooling_factor: expected ids per example, for the cost estimate.
        min_partition: smallest column-block width for column-wise sharding.
    """

    sharding_types: Optional[List[Union[ShardingType, str]]] = None
    compute_kernels: Optional[List[Union[EmbeddingComputeKernel, str]]] = None
    pooling_factor: float = 1.0
    min_partition: Optional[int] = None

    def __post_init__(self) -> None:
        # TorchRec's tutorials pass the enums' values: ParameterConstraints(sharding_types=["table_wise"])
        if self.sharding_types is not None:
            self.sharding_types = [_member(ShardingType, x, "sharding type") for x in self.sharding_types]
        if self.compute_kernels is not None:
            self.compute_kernels = [_member(EmbeddingComputeKernel, x, "compute kernel") for x in self.compute_kernels]


def _member(enum: Type[E], value: object, what: str) -> E:
    """``value`` as a member of ``enum``: the member itself or its value string."""
    if isinstance(value, enum):
        return value
    names = [m.value for m in enum]
    if isinstance(value, str) and value in names:
        return enum(value)
    raise ValueError(f"unknown {what} {value!r}: recship has {names}")


@dataclass
class Topology:
    """The ranks a plan spreads over.

    Args:
        world_size: number of ranks.
        compute_device: "cpu" or "cuda".
        hbm_cap: bytes of device memory per rank (cuda), default 80 GiB.
        ddr_cap: bytes of host memory per rank (cpu), default 128 GiB.
        local_world_size: ranks per host (table_row_wise shards inside one host);
            defaults to world_size (one host).
    """

    world_size: int
    compute_device: str = "cpu"
    hbm_cap: int = 80 * 1024**3  # TorchRec's order: world_size, compute_device, hbm_cap, ddr_cap, ..., local_world_size
    ddr_cap: int = 128 * 1024**3
    local_world_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.compute_device not in DEVICES:
            raise ValueError(f"compute_device must be 'cpu' or 'cuda', got {self.compute_device!r}")
        if self.local_world_size is None:
            self.local_world_size = self.world_size
        if self.local_world_size < 1 or self.world_size % self.local_world_size != 0:
            raise ValueError(
                f"local_world_size {self.local_world_size} must divide world_size {self.world_size}"
            )

    @property
    def ranks_per_host(self) -> int:
        """``local_world_size``, always set after construction."""
        assert self.local_world_size is not None  # __post_init__ sets it
        return self.local_world_size

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.ranks_per_host

    @property
    def capacity(self) -> int:
        """Bytes each rank may fill with tables and optimizer state."""
        return self.hbm_cap if self.compute_device == "cuda" else self.ddr_cap


@dataclass
class ShardingPlan:
    """module path ("" for the root) -> table name -> ParameterSharding."""

    plan: Dict[str, Dict[str, ParameterSharding]] = field(default_factory=dict)

    def get_plan_for_module(self, module_path: str) -> Optional[Dict[str, ParameterSharding]]:
        return self.plan.get(module_path)

    # -- JSON --------------------------------------------------------------

    def to_json(self) -> str:
        def encode(ps: ParameterSharding) -> dict:
            d = asdict(ps)
            d["sharding_type"] = ps.sharding_type.value
            d["compute_kernel"] = ps.compute_kernel.value
            return d

        body = {path: {t: encode(ps) for t, ps in tables.items()} for path, tables in self.plan.items()}
        return json.dumps({"format": "recship.sharding_plan/1", "plan": body}, indent=2)

    @staticmethod
    def from_json(text: str) -> "ShardingPlan":
        data = json.loads(text)
        if data.get("format") != "recship.sharding_plan/1":
            raise ValueError(f"not a recship sharding plan (format {data.get('format')!r})")
        plan: Dict[str, Dict[str, ParameterSharding]] = {}
        for path, tables in data["plan"].items():
            plan[path] = {
                name: ParameterSharding(
                    sharding_type=ShardingType(d["sharding_type"]),
                    compute_kernel=EmbeddingComputeKernel(d["compute_kernel"]),
                    ranks=list(d["ranks"]),
                    shards=[ShardMetadata(**s) for s in d["shards"]],  # plans saved before "device" read as cpu
                )
                for name, d in tables.items()
            }
        return ShardingPlan(plan)

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def load(path: Union[str, Path]) -> "ShardingPlan":
        return ShardingPlan.from_json(Path(path).read_text())

    # -- printing ----------------------------------------------------------

    def __str__(self) -> str:
        """TorchRec's layout: per module, a table of shardings, then one of shards."""
        out = []
        for path, tables in self.plan.items():
            params = [[name, ps.sharding_type.value, ps.compute_kernel.value, str(ps.ranks)] for name, ps in tables.items()]
            # data-parallel replicas are not shards (TorchRec gives them no sharding spec)
            shards = [
                [name, str(s.shard_offsets), str(s.shard_sizes), s.placement]
                for name, ps in tables.items()
                if ps.sharding_type != ShardingType.DATA_PARALLEL
                for s in ps.shards
            ]
            out.append(
                f"module: {path}\n\n"
                + text_table(["param", "sharding type", "compute kernel", "ranks"], params, center_headers=True)
                + "\n\n"
                + text_table(["param", "shard offsets", "shard sizes", "placement"], shards, center_headers=True)
            )
        return "\n\n".join(out)
