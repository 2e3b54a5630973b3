"""Table configurations: EmbeddingBagConfig (pooled) and EmbeddingConfig (unpooled)."""

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from recship.trainer.types import DataType, PoolingType


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
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: List[str] = field(default_factory=list)
    weight_init_max: Optional[float] = None
    weight_init_min: Optional[float] = None
    init_fn: Optional[Callable[[torch.Tensor], object]] = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an embedding table needs a name")
        for attr in ("num_embeddings", "embedding_dim"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"table {self.name!r}: {attr} must be a positive int, got {value!r}")
        if not isinstance(self.data_type, DataType):
            raise TypeError(f"table {self.name!r}: data_type must be a DataType, got {self.data_type!r}")
        if not self.feature_names:
            self.feature_names = [self.name]
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(f"table {self.name!r}: duplicate feature names {self.feature_names}")
        lo, hi = self.init_range()
        if lo > hi:
            raise ValueError(f"table {self.name!r}: weight_init_min {lo} > weight_init_max {hi}")

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
