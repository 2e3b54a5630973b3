"""The unsharded embedding modules and their configs (TorchRec's ``torchrec.modules`` core): EmbeddingBagCollection,
EmbeddingCollection, the table configs and the DataType / PoolingType enums. Every other layer (trainer, models,
quantize, export) builds on them; they import only ``recship.names`` and ``recship.sparse``."""

from recship.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig
from recship.modules.embedding_modules import (EmbeddingBagCollection, EmbeddingBagCollectionInterface, EmbeddingCollection,
                                               EmbeddingCollectionInterface, get_embedding_names_by_table, materialize)
from recship.modules.types import DataType, PoolingType

__all__ = ["BaseEmbeddingConfig", "DataType", "EmbeddingBagCollection", "EmbeddingBagCollectionInterface", "EmbeddingBagConfig",
           "EmbeddingCollection", "EmbeddingCollectionInterface", "EmbeddingConfig", "PoolingType", "get_embedding_names_by_table",
           "materialize"]
