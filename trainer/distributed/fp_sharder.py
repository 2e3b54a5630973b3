"""FeatureProcessedEmbeddingBagCollectionSharder (TorchRec's ``torchrec.distributed.fp_embeddingbag``).

A FeatureProcessedEmbeddingBagCollection is sharded as its EmbeddingBagCollection is: the
sharder shards ``_embedding_bag_collection`` in place with its EBC sharder and leaves the
feature processors (position weights) in the model as dense parameters, which
DistributedModelParallel puts under DDP and ``dense_parameters()`` hands to the dense
optimizer. The processors run before the input all-to-all, on each rank's own examples;
their weights travel with the ids and their gradients come back the same way
(``SparseFeaturesAllToAll``), so 2 ranks train as one process.

recship plans and shards the inner collection at ``<path>._embedding_bag_collection``; a plan
keyed by the FP-EBC's own path (TorchRec's) is found too.
"""

from typing import Any, Dict, List, Optional, Sequence, Type, cast

import torch
from torch import nn

from recship.trainer.distributed.sharders import EmbeddingBagCollectionSharder
from recship.trainer.distributed.types import ModuleSharder, ShardingEnv
from recship.modules.embedding_modules import EmbeddingBagCollection
from recship.trainer.feature_processors import FeatureProcessedEmbeddingBagCollection


class FeatureProcessedEmbeddingBagCollectionSharder(ModuleSharder[FeatureProcessedEmbeddingBagCollection]):
    """Shards a FeatureProcessedEmbeddingBagCollection's tables with ``ebc_sharder``.

    Args:
        ebc_sharder: the EmbeddingBagCollectionSharder of the inner collection (its
            ``fused_params`` set the tables' fused optimizer); default: one with the default optimizer.
        qcomm_codecs_registry: TorchRec's quantized-communication codecs; recship sends
            full precision, so anything but None is a ValueError.
    """

    def __init__(self, ebc_sharder: Optional[EmbeddingBagCollectionSharder] = None, qcomm_codecs_registry: Optional[Dict[str, Any]] = None) -> None:
        if qcomm_codecs_registry is not None:
            raise ValueError("FeatureProcessedEmbeddingBagCollectionSharder: recship has no quantized communication (qcomm_codecs_registry)")
        if ebc_sharder is not None and not isinstance(ebc_sharder, EmbeddingBagCollectionSharder):
            raise TypeError(f"ebc_sharder must be an EmbeddingBagCollectionSharder, got {type(ebc_sharder).__name__}")
        self._ebc_sharder = ebc_sharder or EmbeddingBagCollectionSharder()

    @property
    def ebc_sharder(self) -> EmbeddingBagCollectionSharder:
        return self._ebc_sharder

    @property
    def module_type(self) -> Type[FeatureProcessedEmbeddingBagCollection]:
        return FeatureProcessedEmbeddingBagCollection

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return self._ebc_sharder.sharding_types(compute_device_type)

    def shardable_parameters(self, module: FeatureProcessedEmbeddingBagCollection) -> Dict[str, nn.Parameter]:
        """Table name -> weight of the inner collection (the position weights stay dense)."""
        ebc = module._embedding_bag_collection
        return {t.name: cast(nn.Parameter, ebc.embedding_bags[t.name].weight) for t in ebc.embedding_bag_configs()}

    def shard(
        self,
        module: FeatureProcessedEmbeddingBagCollection,
        params: Dict[str, Any],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> FeatureProcessedEmbeddingBagCollection:
        """``module`` with its collection replaced by this rank's ShardedEmbeddingBagCollection (a collective)."""
        if not isinstance(module, FeatureProcessedEmbeddingBagCollection):
            raise TypeError(f"FeatureProcessedEmbeddingBagCollectionSharder shards FeatureProcessedEmbeddingBagCollection, got {type(module).__name__}")
        ebc = module._embedding_bag_collection
        if not isinstance(ebc, EmbeddingBagCollection):
            raise ValueError("this FeatureProcessedEmbeddingBagCollection is sharded already")
        module._embedding_bag_collection = self._ebc_sharder.shard(ebc, params, env, device)  # type: ignore[assignment]
        if device is not None and device.type != "meta":
            module._feature_processors.to(device)
        return module

    def __repr__(self) -> str:
        return f"FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder={self._ebc_sharder!r})"


def fp_ebc_plan_path(module: nn.Module, path: str) -> Optional[str]:
    """The FP-EBC's own path when ``path`` is the collection inside a FeatureProcessedEmbeddingBagCollection
    of ``module`` (where TorchRec's plans key its tables), else None."""
    parent, _, name = path.rpartition(".")
    if name != "_embedding_bag_collection":
        return None
    owner = module.get_submodule(parent) if parent else module
    return parent if isinstance(owner, FeatureProcessedEmbeddingBagCollection) else None
