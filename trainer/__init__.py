"""Training side: embedding tables, their configs and (later) sharding across ranks."""

from recship.trainer.embedding_configs import (
    BaseEmbeddingConfig,
    EmbeddingBagConfig,
    EmbeddingConfig,
)
from recship.trainer.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    materialize,
)
from recship.trainer.types import DataType, PoolingType

__all__ = [
    "BaseEmbeddingConfig",
    "DataType",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "PoolingType",
    "materialize",
]
