"""Sharding vocabulary: how each table is split across ranks, and what a device can hold.

A ``ShardingPlan`` maps module path -> table name -> ``ParameterSharding``; each
``ParameterSharding`` lists its shards as ``ShardMetadata`` (row/column offsets
and sizes of the shard inside the full table, and the rank holding it). Plans
print as a readable table and round-trip through JSON, so a production job can
reuse a static plan.
"""

import abc
import json
from dataclasses import asdict, dataclass, field
from enum import Enum, unique
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Type, TypeVar, Union

from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

from recship.names import DEVICES, EmbeddingComputeKernel, ShardingType
from recship.trainer.planner.constants import (BWD_COMPUTE_MULTIPLIER, CROSS_NODE_BANDWIDTH, DDR_CAP, DDR_MEM_BW, HBM_CAP,
                                              HBM_MEM_BW, HBM_TO_DDR_MEM_BW, INTRA_NODE_BANDWIDTH, SSD_CAP, SSD_MEM_BW,
                                              WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER)
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


class CacheStatistics(abc.ABC):
    """TorchRec's statistics of a table's id stream for sizing its UVM cache (CacheParams.stats)."""

    @property
    @abc.abstractmethod
    def expected_lookups(self) -> float:
        """Distinct ids a step looks up."""

    @abc.abstractmethod
    def expected_miss_rate(self, clf: float) -> float:
        """The miss rate with a cache of ``clf`` (cache load factor)."""

    @property
    @abc.abstractmethod
    def cacheability(self) -> float:
        """How cacheable the id stream is (0: not at all)."""


@dataclass
class CacheParams:
    """TorchRec's UVM-cache settings of a table (fbgemm's fused_uvm_caching kernel, CUDA only). recship keeps whole
    shards in memory: ParameterConstraints / ParameterSharding refuse a CacheParams, naming why."""

    algorithm: Optional[Any] = None
    load_factor: Optional[float] = None
    reserved_memory: Optional[float] = None
    precision: Optional[Any] = None
    prefetch_pipeline: Optional[bool] = None
    stats: Optional[CacheStatistics] = None
    multipass_prefetch_config: Optional[Any] = None


@dataclass
class KeyValueParams:
    """TorchRec's SSD / key-value offload settings of a table (CUDA-only kernels): refused where given, as CacheParams."""

    ssd_storage_directory: Optional[str] = None
    ssd_rocksdb_write_buffer_size: Optional[int] = None
    ssd_rocksdb_shards: Optional[int] = None
    gather_ssd_cache_stats: Optional[bool] = None
    stats_reporter_config: Optional[Any] = None
    use_passed_in_path: bool = True
    l2_cache_size: Optional[int] = None
    max_l1_cache_size: Optional[int] = None
    enable_async_update: Optional[bool] = None
    bulk_init_chunk_size: Optional[int] = None
    lazy_bulk_init_enabled: Optional[bool] = None
    enable_raw_embedding_streaming: Optional[bool] = None
    res_store_shards: Optional[int] = None
    kvzch_tbe_config: Optional[Any] = None
    load_ckpt_without_opt: bool = False
    ps_hosts: Optional[Any] = None
    ps_client_thread_num: Optional[int] = None
    ps_max_key_per_request: Optional[int] = None
    ps_max_local_index_length: Optional[int] = None


@dataclass
class ShardingBucketMetadata:
    """The buckets of a row-wise table sharded with bucketization (TorchRec's; recship's row-wise shards are
    contiguous row ranges, described by ShardMetadata)."""

    num_buckets_per_shard: List[int]
    bucket_offsets_per_shard: List[int]
    bucket_size: int


@unique
class ParameterStorage(Enum):
    """Where a parameter lives: device memory or host memory."""

    HBM = "hbm"
    DDR = "ddr"


@unique
class ComputeDevice(Enum):
    """TorchRec's compute devices (recship runs CPU and CUDA; MTIA has no kernels here)."""

    CUDA = "cuda"
    CPU = "cpu"
    MTIA = "mtia"


class ComputeKernel(Enum):
    """TorchRec's base of compute-kernel enums (EmbeddingComputeKernel is recship's)."""

    DEFAULT = "default"


@unique
class StorageUsageType(Enum):
    """Which storage estimate a sharder uses, by sharder kind."""

    BASE_QUANT = "BaseQuantEmbeddingSharder"
    BASE = "BaseEmbeddingSharder"
    DEFAULT = "ModuleSharder"


@unique
class ShardingStrategy(Enum):
    """TorchRec's 2D-parallel sharding strategies (DMPCollection)."""

    DEFAULT = "default"
    PER_MODULE = "per_module"
    FULLY_SHARDED = "fully_sharded"


def check_table_options(owner: str, cache_params: Any = None, enforce_hbm: Optional[bool] = None,
                        stochastic_rounding: Optional[bool] = None, bounds_check_mode: Any = None,
                        output_dtype: Any = None, key_value_params: Any = None) -> None:
    """The per-table settings TorchRec's ``ParameterConstraints`` and ``ParameterSharding`` share, each honoured or
    refused here with why (``owner`` names the object in the error).

    - ``stochastic_rounding``: fbgemm rounds stochastically only when it writes low-precision (fp16) weights;
      recship trains fp32 tables, where neither value changes a bit (as in TorchRec with fp32 tables).
    - ``bounds_check_mode``: recship always checks ids and raises on one out of range (fbgemm's FATAL); WARNING,
      IGNORE and NONE (rewrite, skip or trust such ids) are refused.
    - ``output_dtype``: sharded collections return fp32 (FP32 or None).
    - ``cache_params``, ``enforce_hbm=True``, ``key_value_params``: UVM caching, HBM placement and SSD/key-value
      offload are CUDA kernels (fbgemm's CPU build has none): refused.
    """
    if cache_params is not None:
        raise ValueError(f"{owner}: cache_params={cache_params!r} configures fbgemm's UVM cache (fused_uvm_caching), a "
                         "CUDA-only kernel; recship keeps whole shards in memory: leave cache_params out")
    if enforce_hbm:
        raise ValueError(f"{owner}: enforce_hbm=True places UVM-cached tables in GPU memory (CUDA-only); recship "
                         "has no UVM kernels: leave it out")
    if key_value_params is not None:
        raise ValueError(f"{owner}: key_value_params={key_value_params!r} configures SSD / key-value offloaded tables "
                         "(CUDA-only kernels); recship has none")
    if stochastic_rounding is not None and not isinstance(stochastic_rounding, bool):
        raise TypeError(f"{owner}: stochastic_rounding must be a bool or None, got {stochastic_rounding!r}")
    if bounds_check_mode is not None and getattr(bounds_check_mode, "name", bounds_check_mode) != "FATAL":
        raise ValueError(f"{owner}: bounds_check_mode={bounds_check_mode!r}: recship always refuses an id outside its "
                         "table (fbgemm's BoundsCheckMode.FATAL); it does not rewrite, skip or trust such ids")
    if output_dtype is not None and getattr(output_dtype, "name", output_dtype) != "FP32":
        raise ValueError(f"{owner}: output_dtype={output_dtype!r}: recship's sharded collections return fp32 "
                         "(DataType.FP32)")


@dataclass
class ParameterSharding:
    """The plan for one table: TorchRec's fields, and recship's ``shards``.

    ``shards`` (recship's ShardMetadata: offsets, sizes, rank, device) and ``sharding_spec`` (TorchRec's: torch's
    ``EnumerableShardingSpec``, None for data-parallel replicas) are two views of the same shards: give either
    (a spec is read into ``shards``; one given as the fourth positional argument, TorchRec's order, too) and
    ``sharding_spec`` reads back from ``shards``. The other TorchRec fields are checked by ``check_table_options``.
    """

    sharding_type: ShardingType
    compute_kernel: EmbeddingComputeKernel
    ranks: List[int]
    shards: List[ShardMetadata] = field(default_factory=list)
    sharding_spec: Optional[Any] = field(default=None, compare=False)  # a property below: derived from shards
    cache_params: Optional[Any] = None
    enforce_hbm: Optional[bool] = None
    stochastic_rounding: Optional[bool] = None
    bounds_check_mode: Optional[Any] = None
    output_dtype: Optional[Any] = None
    key_value_params: Optional[Any] = None

    def __post_init__(self) -> None:
        # TorchRec passes the enums' values ("table_wise", "fused"); a kind recship cannot run is refused by name
        self.sharding_type = _member(ShardingType, self.sharding_type, "sharding type")
        self.compute_kernel = _member(EmbeddingComputeKernel, self.compute_kernel, "compute kernel")
        if hasattr(self.shards, "shards") and not isinstance(self.shards, list):  # TorchRec's 4th field: a spec
            spec, self.shards = self.shards, []
            self.sharding_spec = spec
        check_table_options(f"ParameterSharding({self.sharding_type.value})", self.cache_params, self.enforce_hbm,
                            self.stochastic_rounding, self.bounds_check_mode, self.output_dtype, self.key_value_params)


def _get_sharding_spec(self: ParameterSharding) -> Optional[Any]:
    """TorchRec's view of ``shards``: torch's ``EnumerableShardingSpec`` of ``ShardMetadata`` (offsets, sizes,
    placement "rank:<r>/<device>"), or None for data-parallel replicas."""
    if self.sharding_type == ShardingType.DATA_PARALLEL:
        return None
    return EnumerableShardingSpec([
        TorchShardMetadata(shard_offsets=list(s.shard_offsets), shard_sizes=list(s.shard_sizes), placement=s.placement)
        for s in self.shards
    ])


def _set_sharding_spec(self: ParameterSharding, spec: Optional[Any]) -> None:
    """A given spec becomes ``shards`` (it must agree with shards given too)."""
    if spec is None or isinstance(spec, property):
        return
    shards = [ShardMetadata(list(m.shard_offsets), list(m.shard_sizes), m.placement.rank(), str(m.placement.device()))
              for m in spec.shards]
    if self.shards and [(s.shard_offsets, s.shard_sizes, s.rank) for s in self.shards] != [
            (s.shard_offsets, s.shard_sizes, s.rank) for s in shards]:
        raise ValueError(f"ParameterSharding: sharding_spec {spec} and shards {self.shards} describe different shards")
    self.shards = shards


# after @dataclass, so that __init__ (whose default None is fixed) assigns through the property
ParameterSharding.sharding_spec = property(_get_sharding_spec, _set_sharding_spec)  # type: ignore[assignment]


@dataclass
class ParameterConstraints:
    """What the planner may do with one table (all optional): TorchRec 1.8.0's fields, and recship's ``pooling_factor``.

    Args:
        sharding_types: the allowed sharding types (default: all but data_parallel,
            which replicates the table and must be asked for).
        compute_kernels: the allowed kernels (default: all); ``["dense"]`` alone plans the table
            data-parallel, as in TorchRec (dense is the data-parallel kernel here).
        min_partition: smallest column-block width for column-wise sharding.
        pooling_factors: expected ids per example of each of the table's features (TorchRec's), for the cost
            estimate and the storage reservation; default: ``pooling_factor`` for every feature.
        num_poolings: lookups per example of each feature (default 1 each); scales that feature's ids and outputs.
        batch_sizes: examples per step of each feature (default the planner's batch_size).
        is_weighted: the features carry per-id weights: the storage reservation counts 4 more bytes per id.
        feature_names: the features ``pooling_factors`` etc. are listed for; must be the table's, in order.
        device_group: "cpu" or "cuda"; must be the topology's compute device (recship plans one device kind).
        stochastic_rounding, bounds_check_mode, output_dtype, cache_params, enforce_hbm, key_value_params:
            copied into the table's ParameterSharding, or refused with why (``check_table_options``).
        use_virtual_table: SSD/DRAM virtual tables are CUDA kernels: True is refused.
        pooling_factor: recship's single-number form of ``pooling_factors``.
    """

    sharding_types: Optional[List[Union[ShardingType, str]]] = None
    compute_kernels: Optional[List[Union[EmbeddingComputeKernel, str]]] = None
    min_partition: Optional[int] = None
    pooling_factors: Optional[List[float]] = None
    num_poolings: Optional[List[float]] = None
    batch_sizes: Optional[List[int]] = None
    is_weighted: bool = False
    cache_params: Optional[Any] = None
    enforce_hbm: Optional[bool] = None
    stochastic_rounding: Optional[bool] = None
    bounds_check_mode: Optional[Any] = None
    feature_names: Optional[List[str]] = None
    output_dtype: Optional[Any] = None
    device_group: Optional[str] = None
    key_value_params: Optional[Any] = None
    use_virtual_table: bool = False
    pooling_factor: float = 1.0

    def __post_init__(self) -> None:
        # TorchRec's tutorials pass the enums' values: ParameterConstraints(sharding_types=["table_wise"])
        if self.sharding_types is not None:
            self.sharding_types = [_member(ShardingType, x, "sharding type") for x in self.sharding_types]
        if self.compute_kernels is not None:
            self.compute_kernels = [_member(EmbeddingComputeKernel, x, "compute kernel") for x in self.compute_kernels]
        check_table_options("ParameterConstraints", self.cache_params, self.enforce_hbm, self.stochastic_rounding,
                            self.bounds_check_mode, self.output_dtype, self.key_value_params)
        if self.use_virtual_table:
            raise ValueError("ParameterConstraints(use_virtual_table=True): SSD/DRAM virtual tables are fbgemm CUDA "
                             "kernels; recship has none")
        if self.device_group is not None and self.device_group not in DEVICES:
            raise ValueError(f"ParameterConstraints: device_group must be 'cpu' or 'cuda', got {self.device_group!r}")
        lists: Dict[str, List[Any]] = {n: v for n, v in (("pooling_factors", self.pooling_factors), ("num_poolings", self.num_poolings),
                                   ("batch_sizes", self.batch_sizes), ("feature_names", self.feature_names))
                 if v is not None}
        if len({len(v) for v in lists.values()}) > 1:
            raise ValueError(f"ParameterConstraints: {', '.join(lists)} list one entry per feature: their lengths "
                             f"{[len(v) for v in lists.values()]} differ")
        for name in ("pooling_factors", "num_poolings", "batch_sizes"):
            values = lists.get(name)
            if values is not None and (not values or any(isinstance(v, bool) or not v > 0 for v in values)):
                raise ValueError(f"ParameterConstraints: {name} must be positive numbers, one per feature, got {values}")

    def feature_loads(self, features: List[str], batch_size: int) -> List[Tuple[float, float]]:
        """(ids, pooled outputs) per step of each feature of a table whose features are ``features``.

        Raises ValueError when ``feature_names`` or the per-feature lists do not fit the table's features.
        """
        if self.feature_names is not None and list(self.feature_names) != list(features):
            raise ValueError(f"feature_names {self.feature_names} are not the table's features {features}")
        n = len(features)
        for name in ("pooling_factors", "num_poolings", "batch_sizes"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{name} {values} has {len(values)} entries, the table has {n} features {features}")
        pooling = self.pooling_factors or [self.pooling_factor] * n
        poolings = self.num_poolings or [1.0] * n
        batches = self.batch_sizes or [batch_size] * n
        return [(b * p * k, b * k) for p, k, b in zip(pooling, poolings, batches)]


def _member(enum: Type[E], value: object, what: str) -> E:
    """``value`` as a member of ``enum``: the member itself or its value string."""
    names = [m.value for m in enum]
    if isinstance(value, enum) or (isinstance(value, str) and value in names):
        return enum(value).check_runnable()  # type: ignore[attr-defined]
    raise ValueError(f"unknown {what} {value!r}: recship has {names}")


# Topology's perf-model inputs (TorchRec's defaults): recship's cost model does not weigh them, so other values are refused
_PERF_INPUTS = {"hbm_mem_bw": HBM_MEM_BW, "ddr_mem_bw": DDR_MEM_BW, "ssd_mem_bw": SSD_MEM_BW,
                "hbm_to_ddr_mem_bw": HBM_TO_DDR_MEM_BW, "intra_host_bw": INTRA_NODE_BANDWIDTH,
                "inter_host_bw": CROSS_NODE_BANDWIDTH, "bwd_compute_multiplier": BWD_COMPUTE_MULTIPLIER,
                "weighted_feature_bwd_compute_multiplier": WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER,
                "uneven_sharding_perf_multiplier": 1.0}


@dataclass
class Topology:
    """The ranks a plan spreads over, with TorchRec's parameters.

    Args:
        world_size: number of ranks.
        compute_device: "cpu" or "cuda".
        hbm_cap: bytes of device memory per rank (cuda); None: TorchRec's HBM_CAP (32 GiB).
        ddr_cap: bytes of host memory per rank (cpu); None: TorchRec's DDR_CAP (128 GiB).
        ssd_cap: SSD capacity; recship places no table on SSD (a CUDA-only kernel), so it only records it.
        local_world_size: ranks per host (table_row_wise shards inside one host); defaults to world_size (one host).
        pod_size: TorchRec's pods of hosts for its comms model: None or world_size (one pod).
        hbm_mem_bw ... uneven_sharding_perf_multiplier: TorchRec's perf-model inputs; recship's planner has one
            fixed cost model (floats a shard reads and sends per step) that does not weigh them: TorchRec's
            defaults only, another value is refused.
        custom_topology_data, generalized_comms_bandwidths: per-device capacities and bandwidth models: refused.
        created_by_factory: TorchRec's TopologyFactory marker (recorded).
    """

    world_size: int
    compute_device: str
    hbm_cap: Optional[int] = None
    ddr_cap: Optional[int] = None
    ssd_cap: Optional[int] = None
    local_world_size: Optional[int] = None
    pod_size: Optional[int] = None
    hbm_mem_bw: float = HBM_MEM_BW
    ddr_mem_bw: float = DDR_MEM_BW
    ssd_mem_bw: float = SSD_MEM_BW
    hbm_to_ddr_mem_bw: float = HBM_TO_DDR_MEM_BW
    intra_host_bw: float = INTRA_NODE_BANDWIDTH
    inter_host_bw: float = CROSS_NODE_BANDWIDTH
    bwd_compute_multiplier: float = BWD_COMPUTE_MULTIPLIER
    custom_topology_data: Optional[Any] = None
    weighted_feature_bwd_compute_multiplier: float = WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER
    uneven_sharding_perf_multiplier: float = 1.0
    generalized_comms_bandwidths: Optional[Any] = None
    created_by_factory: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.compute_device not in DEVICES:
            raise ValueError(f"compute_device must be 'cpu' or 'cuda', got {self.compute_device!r}")
        self.hbm_cap = HBM_CAP if self.hbm_cap is None else self.hbm_cap
        self.ddr_cap = DDR_CAP if self.ddr_cap is None else self.ddr_cap
        self.ssd_cap = SSD_CAP if self.ssd_cap is None else self.ssd_cap
        if self.local_world_size is None:
            self.local_world_size = self.world_size
        if self.local_world_size < 1 or self.world_size % self.local_world_size != 0:
            raise ValueError(
                f"local_world_size {self.local_world_size} must divide world_size {self.world_size}"
            )
        if self.pod_size is not None and self.pod_size != self.world_size:
            raise ValueError(f"Topology(pod_size={self.pod_size}): recship plans one pod (pod_size None or world_size "
                             f"{self.world_size}); TorchRec's pods only change its comms model")
        changed = [f"{k}={getattr(self, k)!r}" for k, v in _PERF_INPUTS.items() if getattr(self, k) != v]
        if changed:
            raise ValueError(f"Topology({', '.join(changed)}): recship's planner has one fixed cost model (floats a shard "
                             "reads and sends per step) that does not weigh bandwidths or compute multipliers; leave "
                             "them at TorchRec's defaults")
        for name in ("custom_topology_data", "generalized_comms_bandwidths"):
            if getattr(self, name) is not None:
                raise ValueError(f"Topology({name}=...): recship's planner gives every rank the same capacity and one "
                                 "cost model; leave it out")

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
        assert self.hbm_cap is not None and self.ddr_cap is not None  # __post_init__ sets them
        return self.hbm_cap if self.compute_device == "cuda" else self.ddr_cap


class ModuleShardingPlan:
    """TorchRec's base of one module's plan."""


class EmbeddingModuleShardingPlan(ModuleShardingPlan, Dict[str, ParameterSharding]):
    """One embedding collection's plan, table name -> ParameterSharding: a dict, as TorchRec's
    (``construct_module_sharding_plan`` and the planner give one per collection). Prints as TorchRec's does."""

    def __str__(self) -> str:
        return _module_tables(self)


@unique
class ObjectPoolShardingType(Enum):
    """How an object pool (``recship.models.object_pools``' TensorPool, KeyedJaggedTensorPool) is split over ranks
    (TorchRec's ``torchrec.distributed.types.ObjectPoolShardingType``): ROW_WISE: contiguous blocks of its ids per
    rank; REPLICATED_ROW_WISE: row-wise within a node and replicated across nodes."""

    ROW_WISE = "row_wise"
    REPLICATED_ROW_WISE = "replicated_row_wise"


@dataclass
class ObjectPoolShardingPlan(ModuleShardingPlan):
    """One object pool's plan (TorchRec's fields and defaults).

    Args:
        sharding_type: an ObjectPoolShardingType.
        inference: the plan is for an inference (read-only) pool.
        memory_capacity_per_rank: bytes each rank can give the pool, one int per rank, for pools split unevenly
            across ranks; None: even blocks.
    """

    sharding_type: ObjectPoolShardingType
    inference: bool = False
    memory_capacity_per_rank: Optional[List[int]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.sharding_type, ObjectPoolShardingType):
            raise TypeError(f"ObjectPoolShardingPlan.sharding_type must be an ObjectPoolShardingType, got {self.sharding_type!r}")
        capacity = self.memory_capacity_per_rank
        if capacity is not None and (not capacity or any(not isinstance(c, int) or c < 0 for c in capacity)):
            raise ValueError(f"ObjectPoolShardingPlan.memory_capacity_per_rank must be non-negative ints, one per rank, got {capacity!r}")

    def _serialize(self) -> Dict[str, Any]:
        """TorchRec's serialized form: the type's member name, ``inference``, and the capacities when set."""
        out: Dict[str, Any] = {"sharding_type": self.sharding_type.name, "inference": self.inference}
        if self.memory_capacity_per_rank is not None:
            out["memory_capacity_per_rank"] = list(self.memory_capacity_per_rank)
        return out


def _module_tables(tables: Dict[str, ParameterSharding]) -> str:
    """TorchRec's layout of one module's plan: a table of shardings, then one of shards."""
    params = [[name, ps.sharding_type.value, ps.compute_kernel.value, str(ps.ranks)] for name, ps in tables.items()]
    # data-parallel replicas are not shards (TorchRec gives them no sharding spec)
    shards = [
        [name, str(s.shard_offsets), str(s.shard_sizes), s.placement]
        for name, ps in tables.items()
        if ps.sharding_type != ShardingType.DATA_PARALLEL
        for s in ps.shards
    ]
    return (text_table(["param", "sharding type", "compute kernel", "ranks"], params, center_headers=True) + "\n\n"
            + text_table(["param", "shard offsets", "shard sizes", "placement"], shards, center_headers=True))


@dataclass
class ShardingPlan:
    """module path ("" for the root) -> table name -> ParameterSharding."""

    plan: Dict[str, Dict[str, ParameterSharding]] = field(default_factory=dict)

    def get_plan_for_module(self, module_path: str) -> Optional[Dict[str, ParameterSharding]]:
        return self.plan.get(module_path)

    # -- JSON --------------------------------------------------------------

    def to_json(self) -> str:
        def encode(ps: ParameterSharding) -> dict:
            d: Dict[str, Any] = {"sharding_type": ps.sharding_type.value, "compute_kernel": ps.compute_kernel.value,
                                 "ranks": list(ps.ranks), "shards": [asdict(s) for s in ps.shards]}
            # TorchRec's per-table options recship honours (the others are refused at construction), by name
            for name in ("stochastic_rounding", "bounds_check_mode", "output_dtype"):
                value = getattr(ps, name)
                if value is not None:
                    d[name] = getattr(value, "name", value)
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
            plan[path] = EmbeddingModuleShardingPlan({
                name: ParameterSharding(
                    sharding_type=ShardingType(d["sharding_type"]),
                    compute_kernel=EmbeddingComputeKernel(d["compute_kernel"]),
                    ranks=list(d["ranks"]),
                    shards=[ShardMetadata(**s) for s in d["shards"]],  # plans saved before "device" read as cpu
                    **{k: d[k] for k in ("stochastic_rounding", "bounds_check_mode", "output_dtype") if k in d},
                )
                for name, d in tables.items()
            })
        return ShardingPlan(plan)

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def load(path: Union[str, Path]) -> "ShardingPlan":
        return ShardingPlan.from_json(Path(path).read_text())

    # -- printing ----------------------------------------------------------

    def __str__(self) -> str:
        """TorchRec's layout: per module, a table of shardings, then one of shards."""
        return "\n\n".join(f"module: {path}\n\n" + _module_tables(tables) for path, tables in self.plan.items())
