"""Sharded embedding modules and the collectives between ranks."""

from recship.trainer.distributed.sharded_ebc import LookupUnit, ShardedEmbeddingBagCollection

__all__ = ["LookupUnit", "ShardedEmbeddingBagCollection"]
