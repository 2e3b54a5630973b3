"""Table configurations: EmbeddingBagConfig (pooled) and EmbeddingConfig (unpooled), with TorchRec's fields and
module-level conversions (``data_type_to_dtype``, ``pooling_type_to_str``, ...; defined beside the enums in
recship.names).

TorchRec 1.8.0's fields for virtual (SSD/DRAM key-value) tables and in-place embedding updates are here so a
TorchRec config constructs unchanged; recship has no such kernel, so a config that turns one on
(``use_virtual_table=True``, a ``virtual_table_eviction_policy``, ``enable_embedding_update=True``,
``stash_weights=True``, ``num_embeddings_post_pruning``) is a ValueError naming the field, never a table quietly
trained another way. The eviction-policy dataclasses are TorchRec's, fields and defaults.
"""

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from recship.names import (data_type_to_dtype, data_type_to_sparse_type, dtype_to_data_type, pooling_type_to_pooling_mode,
                           pooling_type_to_str)
from recship.modules.types import DataType, PoolingType


@dataclass
class VirtualTableEvictionPolicy:
    """How a virtual table evicts ids (TorchRec's; recship has no virtual table, so a config holding one is refused).
    ``meta_header_len``: the per-row metadata header, in elements of the table's type (16 bytes)."""

    meta_header_len: int = 0
    embedding_dim: int = 0
    initialized: bool = False

    def init_metaheader_config(self, data_type: DataType, embedding_dim: int) -> None:
        """Sets the header length for ``data_type`` (16 bytes: the id, a timestamp, a used bit and a count) once."""
        if self.initialized:
            return
        self.meta_header_len = 16 // data_type_to_dtype(data_type).itemsize
        self.embedding_dim = embedding_dim
        self.initialized = True

    def get_meta_header_len(self) -> int:
        return self.meta_header_len

    def get_embedding_dim(self) -> int:
        return self.embedding_dim


@dataclass
class CountBasedEvictionPolicy(VirtualTableEvictionPolicy):
    """Evicts ids whose decayed count falls below ``eviction_threshold`` (0: never)."""

    training_id_eviction_trigger_count: int = 0
    eviction_threshold: int = 15
    decay_rate: float = 0.99
    inference_eviction_threshold: Optional[int] = None  # None: eviction_threshold

    def __post_init__(self) -> None:
        if self.inference_eviction_threshold is None:
            self.inference_eviction_threshold = self.eviction_threshold


@dataclass
class FeatureScoreBasedEvictionPolicy(VirtualTableEvictionPolicy):
    """Evicts ids by a per-feature score (or by age when ``eviction_ttl_mins`` is set)."""

    decay_rate: float = 0.99
    training_id_eviction_trigger_count: int = 0
    training_id_keep_count: int = 0
    eviction_ttl_mins: int = 0
    max_inference_id_num_per_rank: int = 0  # 0: training_id_keep_count
    inference_eviction_feature_score_threshold: Optional[float] = None  # None: 0
    inference_eviction_ttl_mins: Optional[int] = None  # None: eviction_ttl_mins
    feature_score_mapping: Optional[Dict[str, float]] = None
    feature_score_default_value: Optional[float] = None
    enable_auto_feature_score_collection: bool = False
    enable_eviction: bool = True

    def __post_init__(self) -> None:
        if self.inference_eviction_feature_score_threshold is None:
            self.inference_eviction_feature_score_threshold = 0
        if self.inference_eviction_ttl_mins is None:
            self.inference_eviction_ttl_mins = self.eviction_ttl_mins
        if self.max_inference_id_num_per_rank == 0:
            self.max_inference_id_num_per_rank = self.training_id_keep_count
        if self.enable_auto_feature_score_collection and self.feature_score_mapping is None:
            self.feature_score_mapping = {}


@dataclass
class FeatureScoreMapping:
    """Feature name -> score, for FeatureScoreBasedEvictionPolicy."""

    feature_score_mapping: Dict[str, float] = field(default_factory=dict)
    eviction_enabled: bool = False


@dataclass
class TimestampBasedEvictionPolicy(VirtualTableEvictionPolicy):
    """Evicts ids not seen for ``eviction_ttl_mins`` (0: never)."""

    training_id_eviction_trigger_count: int = 0
    eviction_ttl_mins: int = 24 * 60
    inference_eviction_ttl_mins: Optional[int] = None  # None: eviction_ttl_mins
    max_inference_id_num_per_rank: int = 0

    def __post_init__(self) -> None:
        if self.inference_eviction_ttl_mins is None:
            self.inference_eviction_ttl_mins = self.eviction_ttl_mins


@dataclass
class CountTimestampMixedEvictionPolicy(VirtualTableEvictionPolicy):
    """Evicts by count and by age."""

    training_id_eviction_trigger_count: int = 0
    eviction_threshold: int = 15
    decay_rate: float = 0.99
    eviction_ttl_mins: int = 24 * 60
    inference_eviction_threshold: Optional[int] = None  # None: eviction_threshold
    inference_eviction_ttl_mins: Optional[int] = None  # None: eviction_ttl_mins

    def __post_init__(self) -> None:
        if self.inference_eviction_ttl_mins is None:
            self.inference_eviction_ttl_mins = self.eviction_ttl_mins
        if self.inference_eviction_threshold is None:
            self.inference_eviction_threshold = self.eviction_threshold


@dataclass
class FeatureL2NormBasedEvictionPolicy(VirtualTableEvictionPolicy):
    """Evicts ids whose row's L2 norm falls below ``eviction_threshold`` (0.0: never)."""

    training_id_eviction_trigger_count: int = 0
    eviction_threshold: float = 0.0
    inference_eviction_threshold: Optional[float] = None  # None: eviction_threshold

    def __post_init__(self) -> None:
        if self.inference_eviction_threshold is None:
            self.inference_eviction_threshold = self.eviction_threshold


@dataclass
class NoEvictionPolicy(VirtualTableEvictionPolicy):
    """Never evicts."""


# The fields recship carries but has no kernel for: their TorchRec default is the only value it accepts.
_UNSUPPORTED_DEFAULTS = {
    "num_embeddings_post_pruning": None,
    "use_virtual_table": False,
    "virtual_table_eviction_policy": None,
    "enable_embedding_update": False,
    "stash_weights": False,
}


@dataclass
class BaseEmbeddingConfig:
    """One embedding table.

    Args:
        num_embeddings: rows; ids of its features must lie in [0, num_embeddings).
        embedding_dim: columns.
        name: the table's name; state-dict keys use it.
        data_type: storage type of the weights.
        feature_names: the sparse features looked up in this table (several
            features may share one table); defaults to ``[name]``.
        weight_init_min / weight_init_max: uniform init range; defaults to
            +-sqrt(1 / num_embeddings).
        init_fn: custom in-place initialiser ``fn(weight)``; overrides the range.
        need_pos: the table's features are position-weighted (TorchRec's flag for row-wise sharding; carried).
        input_dim: TorchRec's input width for special tables (carried).
        total_num_buckets: the id space's bucket count, fixed for the model's life (a positive int; carried).
        num_embeddings_post_pruning, use_virtual_table, virtual_table_eviction_policy, enable_embedding_update,
            stash_weights: TorchRec's inference pruning, virtual tables and embedding updates; recship has none,
            so anything but the default is a ValueError.
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: List[str] = field(default_factory=list)
    weight_init_max: Optional[float] = None
    weight_init_min: Optional[float] = None
    num_embeddings_post_pruning: Optional[int] = None
    init_fn: Optional[Callable[[torch.Tensor], object]] = None
    need_pos: bool = False
    input_dim: Optional[int] = None
    total_num_buckets: Optional[int] = None
    use_virtual_table: bool = False
    virtual_table_eviction_policy: Optional[VirtualTableEvictionPolicy] = None
    enable_embedding_update: bool = False
    stash_weights: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an embedding table needs a name")
        for attr in ("num_embeddings", "embedding_dim"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"table {self.name!r}: {attr} must be a positive int, got {value!r}")
        if not isinstance(self.data_type, DataType):
            raise TypeError(f"table {self.name!r}: data_type must be a DataType, got {self.data_type!r}")
        if not self.data_type.is_table_type:
            stored = ", ".join(d.name for d in DataType if d.is_table_type)
            raise ValueError(f"table {self.name!r}: data_type {self.data_type.name} is not an embedding storage type; "
                             f"recship tables are stored as one of {stored}")
        if not self.feature_names:
            self.feature_names = [self.name]
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(f"table {self.name!r}: duplicate feature names {self.feature_names}")
        lo, hi = self.init_range()
        if lo > hi:
            raise ValueError(f"table {self.name!r}: weight_init_min {lo} > weight_init_max {hi}")
        for attr, default in _UNSUPPORTED_DEFAULTS.items():
            value = getattr(self, attr)
            if value is not default and value != default:
                raise ValueError(f"table {self.name!r}: {attr}={value!r} is not supported by recship (it has no "
                                 f"inference pruning, virtual tables or embedding updates); leave it {default!r}")
        for attr in ("input_dim", "total_num_buckets"):
            value = getattr(self, attr)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"table {self.name!r}: {attr} must be a positive int or None, got {value!r}")

    def init_range(self) -> tuple[float, float]:
        bound = math.sqrt(1.0 / self.num_embeddings)
        lo = self.weight_init_min if self.weight_init_min is not None else -bound
        hi = self.weight_init_max if self.weight_init_max is not None else bound
        return lo, hi

    def init_weight(self, weight: torch.Tensor) -> None:
        """Initialises ``weight`` [num_embeddings, embedding_dim] in place."""
        with torch.no_grad():
            if self.init_fn is not None:
                self.init_fn(weight)
            else:
                weight.uniform_(*self.init_range())

    def num_features(self) -> int:
        """The features looked up in this table (a method, as TorchRec's)."""
        return len(self.feature_names)

    def get_weight_init_max(self) -> float:
        """The upper end of the uniform init range (``weight_init_max``, else sqrt(1 / num_embeddings)), as TorchRec's."""
        return self.init_range()[1]

    def get_weight_init_min(self) -> float:
        """The lower end of the uniform init range (``weight_init_min``, else -sqrt(1 / num_embeddings)), as TorchRec's."""
        return self.init_range()[0]


@dataclass
class EmbeddingTableConfig(BaseEmbeddingConfig):
    """TorchRec's older all-in-one table config (used by its sharding code): a table with its pooling, whether its
    features are weighted or feature-processed, and its output names."""

    pooling: PoolingType = PoolingType.SUM
    is_weighted: bool = False
    has_feature_processor: bool = False
    embedding_names: List[str] = field(default_factory=list)


@dataclass
class EmbeddingBagConfig(BaseEmbeddingConfig):
    """A pooled table: each example's ids are combined by ``pooling``."""

    pooling: PoolingType = PoolingType.SUM

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pooling not in (PoolingType.SUM, PoolingType.MEAN):
            raise ValueError(
                f"table {self.name!r}: an EmbeddingBagConfig pools with SUM or MEAN, got {self.pooling}"
                " (use EmbeddingConfig for unpooled lookups)"
            )


@dataclass
class EmbeddingConfig(BaseEmbeddingConfig):
    """An unpooled table: every id returns its own row."""


__all__ = ["BaseEmbeddingConfig", "CountBasedEvictionPolicy", "CountTimestampMixedEvictionPolicy", "DataType",
           "EmbeddingBagConfig", "EmbeddingConfig", "EmbeddingTableConfig", "FeatureL2NormBasedEvictionPolicy",
           "FeatureScoreBasedEvictionPolicy", "FeatureScoreMapping", "NoEvictionPolicy", "PoolingType",
           "TimestampBasedEvictionPolicy", "VirtualTableEvictionPolicy", "data_type_to_dtype",
           "data_type_to_sparse_type", "dtype_to_data_type", "pooling_type_to_pooling_mode", "pooling_type_to_str"]
