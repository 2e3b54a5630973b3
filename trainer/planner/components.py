"""The planner's parts under TorchRec's names: storage reservation, enumerator, proposers, PlannerError.

    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=512,
        enumerator=EmbeddingEnumerator(topology, 512, constraints=constraints),
        storage_reservation=HeuristicalStorageReservation(percentage=0.15),
        proposer=[GridSearchProposer(), GreedyProposer()])

What each part does in recship's planner (``recship.trainer.planner.planner``):

- A storage reservation takes memory off every rank before any table is placed: a share
  (``percentage``) of the capacity the plan fills (``hbm_cap`` on cuda, ``ddr_cap`` on cpu),
  the dense part of the model (``parameter_multiplier`` x its parameter bytes, plus its
  buffers; or ``dense_tensor_estimate``) and the batch's ids (20 copies of
  ``batch_size`` x pooling factor int64 per table, or the sum over the constraints'
  ``pooling_factors`` x ``batch_sizes``), as TorchRec's heuristic does; recship adds 4 bytes
  a weight per id for ``is_weighted`` tables.
- The enumerator lists, per table, the sharding types its constraints allow.
- A proposer turns those lists into proposals: per table, the types placement may pick
  from. Greedy: all of them (the placement picks per table); uniform: one type for every
  table; grid search: every combination of one type per table. The planner places every
  proposal (largest table first, least busy rank) and keeps the one whose busiest rank is
  least busy (first proposal on ties).

TorchRec's partitioner, performance model and stats are not replaceable in recship (its
placement and cost model are fixed); passing one is an error that says so.
"""

import itertools
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, Iterator, List, Optional, Sequence

from torch import nn

from recship.names import ShardingType
from recship.trainer.planner.types import ParameterConstraints, Topology

KJT_COPIES = 20  # TorchRec: 2 pipelined batches, each with 10 internal copies of its ids
ID_BYTES = 8  # ids counted as int64
WEIGHT_BYTES = 4  # a weighted feature's fp32 weight per id (ParameterConstraints.is_weighted)


class PlannerErrorType(Enum):
    """Why a plan could not be made (TorchRec's classification)."""

    INSUFFICIENT_STORAGE = "insufficient_storage"
    STRICT_CONSTRAINTS = "strict_constraints"
    PARTITION = "partition"
    OTHER = "other"
    PLANNER_INPUT_CONTEXT_MISMATCH = "planner_input_context_mismatch"
    PLAN_LOADING_FAILED = "plan_loading_failed"
    INVALID_RANK_ASSIGNMENT = "invalid_rank_assignment"
    INPUT_VALIDATION = "input_validation"
    MISSING_MODULE_IN_PLAN = "missing_module_in_plan"
    INVALID_COMPUTE_KERNEL = "invalid_compute_kernel"


class PlannerError(ValueError):
    """TorchRec's planner error: ``error_type`` says why. A ValueError, as recship's planner raised before."""

    def __init__(self, message: str, error_type: PlannerErrorType = PlannerErrorType.OTHER) -> None:
        self.error_type = error_type
        super().__init__(message)


# -- storage reservation -----------------------------------------------------


class StorageReservation:
    """Memory every rank keeps free of tables; ``reserve`` returns the bytes per rank."""

    def reserve(self, topology: Topology, batch_size: int, module: nn.Module,
                shardable: Sequence[nn.Module], constraints: Dict[str, ParameterConstraints]) -> int:
        raise NotImplementedError


class FixedPercentageStorageReservation(StorageReservation):
    """Reserves ``percentage`` (0..1) of each rank's capacity."""

    def __init__(self, percentage: float) -> None:
        self._percentage = _share(percentage)

    def reserve(self, topology: Topology, batch_size: int, module: nn.Module,
                shardable: Sequence[nn.Module], constraints: Dict[str, ParameterConstraints]) -> int:
        return topology.capacity - int((1 - self._percentage) * topology.capacity)


class HeuristicalStorageReservation(StorageReservation):
    """TorchRec's heuristic: a share of capacity, the dense model and the batch's ids, on every rank.

    Args:
        percentage: share (0..1) of each rank's capacity kept as a margin.
        parameter_multiplier: dense parameters take this many times their bytes
            (parameter + optimizer state ~2x + DDP buckets ~3x).
        dense_tensor_estimate: bytes of the dense part, replacing the estimate.
    """

    def __init__(self, percentage: float, parameter_multiplier: float = 6.0,
                 dense_tensor_estimate: Optional[int] = None) -> None:
        self._percentage = _share(percentage)
        if parameter_multiplier < 0:
            raise ValueError(f"parameter_multiplier must be >= 0, got {parameter_multiplier}")
        if dense_tensor_estimate is not None and dense_tensor_estimate < 0:
            raise ValueError(f"dense_tensor_estimate must be >= 0 bytes, got {dense_tensor_estimate}")
        self._parameter_multiplier = parameter_multiplier
        self._dense_tensor_estimate = dense_tensor_estimate
        self.last_reserved: Optional[Dict[str, int]] = None  # bytes of each part, after reserve()

    def reserve(self, topology: Topology, batch_size: int, module: nn.Module,
                shardable: Sequence[nn.Module], constraints: Dict[str, ParameterConstraints]) -> int:
        margin = topology.capacity - int((1 - self._percentage) * topology.capacity)
        dense = self._dense_tensor_estimate
        if dense is None:
            dense = _module_bytes(module, self._parameter_multiplier) - sum(
                _module_bytes(m, self._parameter_multiplier) for m in shardable)
        id_bytes = 0.0
        for m in shardable:
            for t in _tables_of(m):
                c = constraints.get(t.name) or ParameterConstraints()
                if c.pooling_factors is None:
                    ids = c.pooling_factor * (c.batch_sizes[0] if c.batch_sizes else batch_size)
                else:  # TorchRec's: one entry per listed feature, each over its batch size
                    sizes = c.batch_sizes or [batch_size] * len(c.pooling_factors)
                    ids = sum(p * b for p, b in zip(c.pooling_factors, sizes))
                id_bytes += ids * (ID_BYTES + (WEIGHT_BYTES if c.is_weighted else 0))
        kjt = math.ceil(id_bytes) * KJT_COPIES
        self.last_reserved = {"percentage": margin, "dense": dense, "kjt": kjt}
        total = margin + dense + kjt
        if total > topology.capacity:
            raise PlannerError(
                f"the reserved storage ({total} bytes a rank: {self._percentage:.0%} margin {margin}, dense part {dense}, "
                f"batch ids {kjt}) exceeds each rank's capacity ({topology.capacity} bytes): no plan is possible; "
                f"lower percentage, batch_size or the dense estimate, or give the ranks more memory",
                PlannerErrorType.INSUFFICIENT_STORAGE,
            )
        return total


def _share(percentage: float) -> float:
    if isinstance(percentage, bool) or not isinstance(percentage, (int, float)) or not 0 <= percentage <= 1:
        raise ValueError(f"percentage must be a share between 0 and 1, got {percentage!r}")
    return float(percentage)


def _module_bytes(module: nn.Module, multiplier: float) -> int:
    params = sum(multiplier * p.numel() * p.element_size() for p in module.parameters())
    return round(params + sum(b.numel() * b.element_size() for b in module.buffers()))


def _tables_of(module: nn.Module) -> list:
    configs = getattr(module, "embedding_bag_configs", None) or getattr(module, "embedding_configs")
    return list(configs())


# -- estimators and partitioner: recship's fixed models under TorchRec's names -----------------


class ShardEstimator:
    """TorchRec's estimator interface; recship's estimators name its fixed models (see below)."""

    def __init__(self, topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None) -> None:
        self._topology = topology
        self._constraints = constraints


class EmbeddingPerfEstimator(ShardEstimator):
    """TorchRec's perf estimator, here recship's cost model: ``shard_cost`` (floats a shard reads and sends a step).

    ``is_inference=True`` (TorchRec's inference costs) is refused: recship plans training; quantized models are
    sharded by ``_shard_modules``."""

    def __init__(self, topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 is_inference: bool = False) -> None:
        if is_inference:
            raise ValueError("EmbeddingPerfEstimator(is_inference=True): recship's planner plans training; quantized "
                             "models are sharded by recship.distributed._shard_modules")
        super().__init__(topology, constraints)


class PipelineType(Enum):
    """TorchRec's train pipeline kinds, for its storage estimator (recship's estimate is the plain step's)."""

    NONE = "none"
    TRAIN_BASE = "train_base"
    TRAIN_SPARSE_DIST = "train_sparse_dist"
    TRAIN_PREFETCH_SPARSE_DIST = "train_prefetch_sparse_dist"


class EmbeddingStorageEstimator(ShardEstimator):
    """TorchRec's storage estimator, here recship's memory model: ``shard_bytes`` (weights plus the fused
    optimizer's state). TorchRec's pipeline and inference variants are refused."""

    def __init__(self, topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 pipeline_type: PipelineType = PipelineType.NONE, run_embedding_at_peak_memory: bool = False, is_inference: bool = False) -> None:
        if str(getattr(pipeline_type, "value", pipeline_type)).lower() != "none" or run_embedding_at_peak_memory or is_inference:
            raise ValueError(f"EmbeddingStorageEstimator(pipeline_type={pipeline_type!r}, run_embedding_at_peak_memory="
                             f"{run_embedding_at_peak_memory}, is_inference={is_inference}): recship's memory model "
                             "(shard_bytes) counts a training step's tables and optimizer state only; keep the defaults")
        super().__init__(topology, constraints)


class SortBy(Enum):
    """What TorchRec's GreedyPerfPartitioner orders sharding options by."""

    COMPUTE = "compute"
    STORAGE = "storage"
    PERF = "perf"


class Partitioner:
    """TorchRec's partitioner interface."""


class GreedyPerfPartitioner(Partitioner):
    """TorchRec's default partitioner, here recship's placement: tables largest first (storage order), each on
    the ranks that keep the busiest rank least busy. ``sort_by`` other than STORAGE and ``balance_modules`` are
    refused (recship has that one order)."""

    def __init__(self, sort_by: SortBy = SortBy.STORAGE, balance_modules: bool = False) -> None:
        if SortBy(getattr(sort_by, "value", sort_by)) is not SortBy.STORAGE or balance_modules:
            raise ValueError(f"GreedyPerfPartitioner(sort_by={sort_by}, balance_modules={balance_modules}): recship "
                             "places tables largest first (SortBy.STORAGE) over all modules at once; keep the defaults")


def check_estimators(estimator: Any) -> None:
    """An enumerator's ``estimator`` argument: recship's estimators (its fixed models) or None, else a ValueError."""
    given = estimator if isinstance(estimator, list) else [estimator]
    foreign = [e for e in given if e is not None and not isinstance(e, (EmbeddingPerfEstimator, EmbeddingStorageEstimator))]
    if foreign:
        raise ValueError(f"EmbeddingEnumerator(estimator={foreign!r}): recship's planner has one fixed cost and memory "
                        "model (EmbeddingPerfEstimator: shard_cost, EmbeddingStorageEstimator: shard_bytes); it takes "
                        "no other estimators")


# -- enumerator -----------------------------------------------------------------


@dataclass
class TableOptions:
    """One table the planner places: its collection's path, config and the sharding types it may use."""

    path: str
    table: object  # EmbeddingBagConfig or EmbeddingConfig
    sharding_types: List[ShardingType]


class Enumerator:
    """TorchRec's enumerator interface: what a planner's ``enumerator`` is (recship's is EmbeddingEnumerator)."""

    def __init__(self, topology: Topology, batch_size: int = 512, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 estimator: object = None) -> None:
        check_estimators(estimator)
        self.topology = topology
        self.batch_size = batch_size
        self.constraints: Dict[str, ParameterConstraints] = dict(constraints or {})


class ShardingPlanner:
    """TorchRec's planner interface (``torchrec.distributed.types.ShardingPlanner``): ``plan(module, sharders)``
    and ``collective_plan(module, sharders, pg)``; recship's is EmbeddingShardingPlanner."""

    def plan(self, module: nn.Module, sharders: Any) -> Any:
        raise NotImplementedError

    def collective_plan(self, module: nn.Module, sharders: Any, pg: Any = None) -> Any:
        raise NotImplementedError


class EmbeddingEnumerator(Enumerator):
    """Lists every shardable table with the sharding types its constraints allow (TorchRec's enumerator).

    Args:
        topology: the ranks; must be the planner's.
        batch_size: examples per rank per step; must be the planner's.
        constraints: table name -> ParameterConstraints.
        estimator: TorchRec's shard estimators: recship's EmbeddingPerfEstimator / EmbeddingStorageEstimator (its
            fixed cost and memory models) or None; any other is refused.
        use_exact_enumerate_order: recship places tables largest first always (must be False).
    """

    def __init__(self, topology: Topology, batch_size: int, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 estimator: object = None, use_exact_enumerate_order: Optional[bool] = False) -> None:
        check_estimators(estimator)
        if use_exact_enumerate_order:
            raise ValueError("EmbeddingEnumerator(use_exact_enumerate_order=True): recship's planner always places "
                             "tables largest first")
        self.topology = topology
        self.batch_size = batch_size
        self.constraints: Dict[str, ParameterConstraints] = dict(constraints or {})


# -- proposers ----------------------------------------------------------------


class Proposer:
    """Turns each table's allowed sharding types into proposals (per table, the types placement may use)."""

    def proposals(self, allowed: List[List[ShardingType]]) -> Iterator[List[List[ShardingType]]]:
        raise NotImplementedError


class GreedyProposer(Proposer):
    """One proposal: every allowed type of every table; placement picks per table, largest table first."""

    def __init__(self, use_depth: bool = True, threshold: Optional[int] = None) -> None:
        if not use_depth or threshold is not None:
            raise ValueError(f"GreedyProposer(use_depth={use_depth}, threshold={threshold}): recship's greedy proposal "
                             "has one search order (use_depth=True, no threshold)")

    def proposals(self, allowed: List[List[ShardingType]]) -> Iterator[List[List[ShardingType]]]:
        yield [list(types) for types in allowed]


class UniformProposer(Proposer):
    """One proposal per sharding type every table allows: that type for all tables."""

    def __init__(self, use_depth: bool = True) -> None:
        if not use_depth:
            raise ValueError("UniformProposer(use_depth=False): recship's proposers have one search order")

    def proposals(self, allowed: List[List[ShardingType]]) -> Iterator[List[List[ShardingType]]]:
        if not allowed:
            return
        for st in allowed[0]:
            if all(st in types for types in allowed):
                yield [[st] for _ in allowed]


class GridSearchProposer(Proposer):
    """Every combination of one sharding type per table, in order, when there are at most ``max_proposals``.

    More combinations than that: no proposals (as TorchRec's, which then leaves it to the others).
    """

    def __init__(self, max_proposals: int = 10000) -> None:
        if isinstance(max_proposals, bool) or not isinstance(max_proposals, int) or max_proposals < 1:
            raise ValueError(f"max_proposals must be a positive int, got {max_proposals!r}")
        self._max_proposals = max_proposals

    def proposals(self, allowed: List[List[ShardingType]]) -> Iterator[List[List[ShardingType]]]:
        if math.prod(len(types) for types in allowed) > self._max_proposals:
            return
        for combo in itertools.product(*allowed):
            yield [[st] for st in combo]


class DynamicProgrammingProposer(Proposer):
    """TorchRec's HBM-binned dynamic-programming proposer: not in recship (refused at construction, naming why)."""

    def __init__(self, hbm_bins_per_device: int = 100) -> None:
        raise ValueError("DynamicProgrammingProposer: recship has no dynamic-programming proposer (it bins HBM per "
                         "device); use GreedyProposer, UniformProposer or GridSearchProposer")


class EmbeddingOffloadScaleupProposer(Proposer):
    """TorchRec's proposer of UVM-cache sizes: refused (UVM caching is CUDA-only)."""

    def __init__(self, use_depth: bool = True) -> None:
        raise ValueError("EmbeddingOffloadScaleupProposer sizes UVM caches (fused_uvm_caching), a CUDA-only kernel; "
                         "recship has none")


def proposers_of(proposer: object) -> List[Proposer]:
    """The planner's ``proposer`` argument as a list of recship proposers (default: greedy)."""
    if proposer is None:
        return [GreedyProposer()]
    given: List[object] = list(proposer) if isinstance(proposer, list) else [proposer]
    if not given:
        raise ValueError("proposer=[] proposes nothing: give at least one proposer (or None for the greedy one)")
    proposers: List[Proposer] = []
    for p in given:
        if not isinstance(p, Proposer):
            raise TypeError(f"recship's planner takes its own proposers (GreedyProposer, UniformProposer, "
                            f"GridSearchProposer), got {type(p).__name__}")
        proposers.append(p)
    return proposers
