"""Embedding collections behind managed collisions (TorchRec's ``torchrec.modules.mc_embedding_modules``
and ``torchrec.modules.mc_adapter``).

A ManagedCollisionEmbeddingBagCollection remaps a KeyedJaggedTensor of raw ids with its
ManagedCollisionCollection, then pools the remapped ids with its EmbeddingBagCollection:

    tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100, feature_names=["f"])]
    mc_ebc = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables),
        ManagedCollisionCollection({"t": MCHManagedCollisionModule(
            zch_size=100, device=torch.device("cpu"), eviction_policy=DistanceLFU_EvictionPolicy(),
            eviction_interval=10, input_hash_size=2**40)}, tables),
        return_remapped_features=True)
    pooled, remapped = mc_ebc(kjt)  # KeyedTensor ["f"]: [B, 8]; KJT of the rows looked up

State-dict keys are TorchRec's: ``_embedding_module.embedding_bags.<table>.weight`` and
``_managed_collision_collection._managed_collision_modules.<table>._mch_sorted_raw_ids`` (and
``_mch_remapped_ids_mapping``, ``_mch_<metadata>``, ``_output_segments_tensor``, ``_current_iter_tensor``).
As in TorchRec 1.8.0 unsharded, a row whose slot changes hands keeps its weights (``evict`` is a no-op).
"""

from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
from torch import nn

from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.managed_collisions.eviction import DistanceLFU_EvictionPolicy
from recship.trainer.managed_collisions.modules import ManagedCollisionCollection, MCHManagedCollisionModule


def evict(evictions: Dict[str, Optional[torch.Tensor]], ebc: nn.Module) -> None:
    """TorchRec's hook for resetting evicted rows of an unsharded collection: a no-op in TorchRec 1.8.0,
    kept so (rows keep their trained weights when their slot changes hands)."""
    return


@torch.fx.wrap
def return_remapped_lengths_as_mask(features: KeyedJaggedTensor) -> torch.Tensor:
    """[F * B] bool: which bags of the remapped features are non-empty."""
    return features.lengths().to(torch.bool)


@torch.fx.wrap
def return_custom_metadata(runtime_meta: torch.Tensor) -> torch.Tensor:
    return runtime_meta


class BaseManagedCollisionEmbeddingCollection(nn.Module):
    """A ManagedCollisionCollection in front of an EmbeddingBagCollection or EmbeddingCollection.

    Args:
        embedding_module: the collection looking up the remapped ids.
        managed_collision_collection: its tables' configs must equal the collection's.
        return_remapped_features: forward also returns the remapped KJT (else None).
        allow_in_place_embed_weight_update: TorchRec's sharded modules reset evicted rows in place
            with it; kept for the API.
    """

    def __init__(
        self,
        embedding_module: Union[EmbeddingBagCollection, EmbeddingCollection],
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(managed_collision_collection, ManagedCollisionCollection):
            raise TypeError(f"managed_collision_collection must be a ManagedCollisionCollection, got {type(managed_collision_collection).__name__}")
        self._managed_collision_collection = managed_collision_collection
        self._return_remapped_features = return_remapped_features
        self._allow_in_place_embed_weight_update = allow_in_place_embed_weight_update
        self._embedding_module: Union[EmbeddingBagCollection, EmbeddingCollection] = embedding_module
        configs: Sequence[BaseEmbeddingConfig]
        if isinstance(embedding_module, EmbeddingBagCollection):
            configs, kind = embedding_module.embedding_bag_configs(), "EmbeddingBagCollection"
        elif isinstance(embedding_module, EmbeddingCollection):
            configs, kind = embedding_module.embedding_configs(), "EmbeddingCollection"
        else:
            raise TypeError(f"embedding_module must be an EmbeddingBagCollection or EmbeddingCollection, got {type(embedding_module).__name__}")
        if list(configs) != list(managed_collision_collection.embedding_configs()):
            raise ValueError(f"the {kind} and the ManagedCollisionCollection must hold the same embedding configs")

    def forward(
        self,
        features: KeyedJaggedTensor,
        mutate_miss_lengths: bool = True,
    ) -> Tuple[Union[KeyedTensor, Dict[str, JaggedTensor]], Optional[KeyedJaggedTensor]]:
        """features: KJT of raw ids -> (the collection's output on the remapped ids, the remapped KJT
        when ``return_remapped_features`` else None)."""
        self._check_sharded_together()
        features = self._managed_collision_collection(features, mutate_miss_lengths=mutate_miss_lengths)
        embedding_res = self._embedding_module(features)
        evict(self._managed_collision_collection.evict(), self._embedding_module)
        if not self._return_remapped_features:
            return embedding_res, None
        return embedding_res, features

    def _check_sharded_together(self) -> None:
        """Training a sharded embedding collection behind an unsharded managed-collision collection on several ranks
        would profile each rank's ids into its own diverging state: refused (eval only remaps, so it may)."""
        if not self.training or isinstance(self._embedding_module, (EmbeddingBagCollection, EmbeddingCollection)):
            return
        if type(self._managed_collision_collection) is ManagedCollisionCollection and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(f"this {type(self).__name__}'s embedding collection is sharded but its ManagedCollisionCollection "
                             "is not: shard both with ManagedCollisionEmbeddingBagCollectionSharder / "
                             "ManagedCollisionEmbeddingCollectionSharder (DistributedModelParallel shards both)")

    def lookup_remapped_lengths_mask(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """[F * B] bool: non-empty bags after remapping (runs the remapping, profiling in training)."""
        return return_remapped_lengths_as_mask(self._managed_collision_collection(features, mutate_miss_lengths=True))


class ManagedCollisionEmbeddingCollection(BaseManagedCollisionEmbeddingCollection):
    """Managed collisions in front of an EmbeddingCollection: forward returns
    ({feature: JaggedTensor of [n, dim] embeddings}, remapped KJT or None)."""

    def __init__(
        self,
        embedding_collection: EmbeddingCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        super().__init__(embedding_collection, managed_collision_collection, return_remapped_features, allow_in_place_embed_weight_update)

    @property
    def _embedding_collection(self) -> EmbeddingCollection:
        module = self._embedding_module
        assert isinstance(module, EmbeddingCollection)
        return module


class ManagedCollisionEmbeddingBagCollection(BaseManagedCollisionEmbeddingCollection):
    """Managed collisions in front of an EmbeddingBagCollection: forward returns
    (KeyedTensor of [B, sum of dims] pooled embeddings, remapped KJT or None)."""

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        super().__init__(embedding_bag_collection, managed_collision_collection, return_remapped_features, allow_in_place_embed_weight_update)

    @property
    def _embedding_bag_collection(self) -> nn.Module:
        """The inner collection (a ShardedEmbeddingBagCollection once sharded)."""
        return self._embedding_module


def _sort_zch_modules(
    configs: Sequence[BaseEmbeddingConfig],
    input_hash_size: int,
    device: torch.device,
    eviction_interval: int,
    zch_method: str,
) -> Dict[str, MCHManagedCollisionModule]:
    """A sorted-ids module with DistanceLFU eviction per table (the adapters' "sort_zch")."""
    if zch_method == "mpzch":
        raise NotImplementedError(
            "zch_method='mpzch' (HashZchManagedCollisionModule) is not in recship: fbgemm-gpu-cpu's zero_collision_hash "
            "only looks ids up (readonly) on CPU; use zch_method='sort_zch'"
        )
    if zch_method != "sort_zch":
        raise NotImplementedError(f"zc method {zch_method} is not supported yet")
    return {
        c.name: MCHManagedCollisionModule(
            zch_size=c.num_embeddings,
            device=device,
            input_hash_size=input_hash_size,
            eviction_interval=eviction_interval,
            eviction_policy=DistanceLFU_EvictionPolicy(),
        )
        for c in configs
    }


class _SortZchAdapter(nn.Module):
    """The adapters' constructor (TorchRec's): the collection of ``tables``, built on the meta device as in TorchRec
    (materialise it, or load weights, before the first forward), behind sorted-ids managed collisions with
    DistanceLFU eviction per table (``zch_method="sort_zch"``), as the attribute ``_managed_name``. ``world_size``
    and the ``mpzch_*`` options are TorchRec's, for its hash-probing method (not in recship)."""

    _collection_class: Type[Union[EmbeddingCollection, EmbeddingBagCollection]]
    _managed_class: Type[BaseManagedCollisionEmbeddingCollection]
    _managed_name: str

    def __init__(
        self,
        tables: Sequence[BaseEmbeddingConfig],
        input_hash_size: int,
        device: torch.device,
        world_size: int,
        eviction_interval: int = 1,
        allow_in_place_embed_weight_update: bool = False,
        zch_method: str = "",
        mpzch_num_buckets: Optional[int] = 80,
        mpzch_max_probe: Optional[int] = 100,
    ) -> None:
        super().__init__()
        configs = list(tables)
        collection = self._collection_class(tables=configs, device=torch.device("meta"))  # type: ignore[arg-type]
        modules = _sort_zch_modules(configs, input_hash_size, device, eviction_interval, zch_method)
        managed = self._managed_class(
            collection,  # type: ignore[arg-type]
            ManagedCollisionCollection(modules, configs),  # type: ignore[arg-type]
            allow_in_place_embed_weight_update=allow_in_place_embed_weight_update,
            return_remapped_features=False,
        )
        setattr(self, self._managed_name, managed)


class McEmbeddingCollectionAdapter(_SortZchAdapter):
    """An EmbeddingCollection's tables behind sorted-ids managed collisions (see ``_SortZchAdapter``).

    ``parameters()`` are the collection's only. ``forward(kjt)`` returns {feature: JaggedTensor}; the remapped ids
    of the last call are ``remapped_ids`` (None: TorchRec does not ask the collection for them).
    """

    _collection_class = EmbeddingCollection
    _managed_class = ManagedCollisionEmbeddingCollection
    _managed_name = "mc_embedding_collection"
    mc_embedding_collection: ManagedCollisionEmbeddingCollection
    remapped_ids: Optional[Dict[str, torch.Tensor]] = None

    def forward(self, input: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """input: KJT [F x B x L] of raw ids -> {feature: JaggedTensor of embeddings}."""
        out, remapped = self.mc_embedding_collection(input)
        self.remapped_ids = remapped
        return out

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.mc_embedding_collection._embedding_module.parameters(recurse=recurse)

    def embedding_bag_configs(self) -> List[EmbeddingConfig]:
        """The tables (TorchRec's name for EmbeddingCollection's configs here)."""
        return self.mc_embedding_collection._embedding_collection.embedding_configs()


class McEmbeddingBagCollectionAdapter(_SortZchAdapter):
    """An EmbeddingBagCollection's tables behind sorted-ids managed collisions (see ``_SortZchAdapter``).

    ``forward(kjt)`` returns the KeyedTensor of pooled embeddings; ``parameters()`` are the collection's only.
    """

    _collection_class = EmbeddingBagCollection
    _managed_class = ManagedCollisionEmbeddingBagCollection
    _managed_name = "mc_embedding_bag_collection"
    mc_embedding_bag_collection: ManagedCollisionEmbeddingBagCollection

    def forward(self, input_kjt: KeyedJaggedTensor) -> KeyedTensor:
        """input_kjt: KJT [F x B x L] of raw ids -> KeyedTensor [B, sum of dims]."""
        out, _ = self.mc_embedding_bag_collection(input_kjt)
        return out  # type: ignore[return-value]

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.mc_embedding_bag_collection._embedding_module.parameters(recurse=recurse)

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        ebc = self.mc_embedding_bag_collection._embedding_module
        assert isinstance(ebc, EmbeddingBagCollection)
        return ebc.embedding_bag_configs()


def managed_collision_plan_path(module: nn.Module, path: str) -> Optional[str]:
    """The managed-collision collection's own path when ``path`` is the embedding collection inside one (TorchRec
    keys its tables' plan there, and they shard row-wise only), else None."""
    parent, _, name = path.rpartition(".")
    if name != "_embedding_module":
        return None
    owner = module.get_submodule(parent) if parent else module
    return parent if isinstance(owner, BaseManagedCollisionEmbeddingCollection) else None
