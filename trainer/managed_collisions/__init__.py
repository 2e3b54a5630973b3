"""Managed collisions: raw ids remapped onto a table's rows by frequency or recency (TorchRec's
``torchrec.modules.mc_modules``, ``mc_embedding_modules`` and ``mc_adapter``, one package here).

* ``eviction``: the MCH eviction policies (LFU, LRU, DistanceLFU) and threshold filters.
* ``modules``: ManagedCollisionModule, MCHManagedCollisionModule, ManagedCollisionCollection.
* ``embedding``: ManagedCollisionEmbeddingBagCollection / ManagedCollisionEmbeddingCollection and
  the adapters McEmbeddingBagCollectionAdapter / McEmbeddingCollectionAdapter.

TorchRec's hash-ZCH family (``hash_mc_modules``, ``hash_mc_evictions``, ``hash_mc_metrics``:
HashZchManagedCollisionModule and its eviction modules) is not here: it is built on fbgemm's
``zero_collision_hash``, whose CPU kernel in fbgemm-gpu-cpu 1.8.0 only looks ids up (it refuses
``readonly=False``), so it cannot train on CPU.
"""

from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.managed_collisions.embedding import (BaseManagedCollisionEmbeddingCollection,
                                                          ManagedCollisionEmbeddingBagCollection,
                                                          ManagedCollisionEmbeddingCollection, McEmbeddingBagCollectionAdapter,
                                                          McEmbeddingCollectionAdapter, evict, return_custom_metadata,
                                                          return_remapped_lengths_as_mask)
from recship.trainer.managed_collisions.eviction import (DistanceLFU_EvictionPolicy, LFU_EvictionPolicy, LRU_EvictionPolicy,
                                                         MCHEvictionPolicy, MCHEvictionPolicyMetadataInfo,
                                                         average_threshold_filter, dynamic_threshold_filter,
                                                         probabilistic_threshold_filter)
from recship.trainer.managed_collisions.modules import (ManagedCollisionCollection, ManagedCollisionModule,
                                                        MCHManagedCollisionModule, apply_mc_method_to_jt_dict)

__all__ = [
    "BaseEmbeddingConfig", "BaseManagedCollisionEmbeddingCollection", "DistanceLFU_EvictionPolicy", "EmbeddingBagCollection",
    "EmbeddingBagConfig", "EmbeddingCollection", "EmbeddingConfig", "JaggedTensor", "KeyedJaggedTensor", "KeyedTensor",
    "LFU_EvictionPolicy", "LRU_EvictionPolicy", "MCHEvictionPolicy", "MCHEvictionPolicyMetadataInfo", "MCHManagedCollisionModule",
    "ManagedCollisionCollection", "ManagedCollisionEmbeddingBagCollection", "ManagedCollisionEmbeddingCollection",
    "ManagedCollisionModule", "McEmbeddingBagCollectionAdapter", "McEmbeddingCollectionAdapter", "apply_mc_method_to_jt_dict",
    "average_threshold_filter", "dynamic_threshold_filter", "evict", "probabilistic_threshold_filter", "return_custom_metadata",
    "return_remapped_lengths_as_mask",
]
