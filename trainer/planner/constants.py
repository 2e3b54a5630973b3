"""TorchRec's planner constants (``torchrec.distributed.planner.constants``) and its small unit helpers.

recship's planner uses the capacities (``HBM_CAP``, ``DDR_CAP``: Topology's defaults) and ``BATCH_SIZE`` (the
planner's default batch); the bandwidths and multipliers are TorchRec's perf-model inputs, which recship's fixed cost
model does not weigh: Topology takes them at these values and refuses others.
"""

import operator
from functools import reduce
from typing import Any, Iterable, Type, Union

MAX_SIZE: int = (1 << 63) - 1
INTRA_NODE_BANDWIDTH: float = 600 * 1024 * 1024 * 1024 / 1000  # bytes/ms
CROSS_NODE_BANDWIDTH: float = 12.5 * 1024 * 1024 * 1024 / 1000  # bytes/ms
MIN_CW_DIM: int = 128
POOLING_FACTOR: float = 1.0
NUM_POOLINGS: float = 1.0
BIGINT_DTYPE: int = 8
HBM_CAP: int = 32 * 1024 * 1024 * 1024
DDR_CAP: int = 128 * 1024 * 1024 * 1024
SSD_CAP: int = 2 * 1024 * 1024 * 1024 * 1024
DDR_MEM_BW: float = 51 * 1024 * 1024 * 1024 / 1000  # bytes/ms
HBM_MEM_BW: float = 897 * 1024 * 1024 * 1024 / 1000
SSD_MEM_BW: float = 100 * 1024 * 1024 / 1000
HBM_TO_DDR_MEM_BW: float = 32 * 1024 * 1024 * 1024 / 1000
UVM_CACHING_RATIO: float = 0.2
KV_CACHING_RATIO: float = 0.2
BATCH_SIZE: int = 512
BWD_COMPUTE_MULTIPLIER: float = 2
WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER: float = 1
HUNDRED_GB: int = 100 * 1024**3
DEFAULT_PERF_ESTIMATOR: str = "default_estimator"
MAX_PROPOSALS: int = int(1e4)  # GridSearchProposer's default


def sharder_name(t: Type[Any]) -> str:
    """A sharder class's key in the planner's maps: ``module.ClassName``."""
    return t.__module__ + "." + t.__name__


def bytes_to_gb(num_bytes: int) -> float:
    return float(num_bytes / (1024 * 1024 * 1024))


def bytes_to_mb(num_bytes: Union[float, int]) -> float:
    return float(num_bytes / (1024 * 1024))


def gb_to_bytes(gb: float) -> int:
    return int(gb * 1024 * 1024 * 1024)


def mb_to_bytes(mb: float) -> int:
    return int(mb * 1024 * 1024)


def prod(iterable: Iterable[int]) -> int:
    """The product of ``iterable`` (1 when empty)."""
    return reduce(operator.mul, iterable, 1)


__all__ = ["BATCH_SIZE", "BIGINT_DTYPE", "BWD_COMPUTE_MULTIPLIER", "CROSS_NODE_BANDWIDTH", "DDR_CAP", "DDR_MEM_BW",
           "DEFAULT_PERF_ESTIMATOR", "HBM_CAP", "HBM_MEM_BW", "HBM_TO_DDR_MEM_BW", "HUNDRED_GB", "INTRA_NODE_BANDWIDTH",
           "KV_CACHING_RATIO", "MAX_PROPOSALS", "MAX_SIZE", "MIN_CW_DIM", "NUM_POOLINGS", "POOLING_FACTOR", "SSD_CAP", "SSD_MEM_BW",
           "UVM_CACHING_RATIO", "WEIGHTED_FEATURE_BWD_COMPUTE_MULTIPLIER", "bytes_to_gb", "bytes_to_mb", "gb_to_bytes",
           "mb_to_bytes", "prod", "sharder_name"]
