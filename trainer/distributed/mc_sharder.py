"""Row-wise sharded managed collisions (TorchRec's ``torchrec.distributed.mc_modules``, ``mc_embeddingbag``
and ``mc_embedding``): ManagedCollisionCollectionSharder, ManagedCollisionEmbeddingBagCollectionSharder,
ManagedCollisionEmbeddingCollectionSharder.

As in TorchRec, a managed-collision collection is sharded row-wise only, together with its
embedding collection: rank r owns rows [offset_r, offset_r + rows_r) of a table and a managed-collision
module rebuilt for exactly those rows (``rebuild_with_output_id_range``), which gives slots to the raw
ids of its input block. Raw ids are split into ``buckets()`` equal blocks of
``ceil(input_size() / buckets())`` ids, ``buckets() / world_size`` consecutive blocks per rank (fbgemm's
``block_bucketize_sparse_features`` rule, ids beyond the range going to block ``id % buckets``); a
module's ``buckets`` must be a multiple of the world size (TorchRec asserts as much).

Each step, every rank sees the ids of the global batch that fall in its block (feature by feature,
source ranks in order: the order TorchRec's all-to-all delivers them), profiles them (training) and
remaps them into its rows; the remapped ids go back to the ranks they came from, which look them up
in the row-wise sharded collection. recship moves the ids with an all-gather and the remapped ids with
an all-reduce (each id is remapped by exactly one rank), not TorchRec's all-to-alls: the numbers are
the same. A rank's ids without a slot land on its own last row.

State: ``_managed_collision_modules.<table>._mch_sorted_raw_ids`` (and ``_mch_remapped_ids_mapping``,
``_mch_<metadata>``) are ShardedTensors of the table's rows, one shard per rank, as in TorchRec; loading
takes such a state (each rank copies its own shard). Gathered whole and loaded into an unsharded
ManagedCollisionCollection (which re-sorts on load), they remap every id with a slot to the same row.

Where recship differs from TorchRec: evicted rows keep their trained weights and optimizer state
(TorchRec's sharded collections re-initialise them; its unsharded ones keep them, as recship does both ways).
"""

from typing import Any, Dict, List, Optional, Tuple, Type, cast

import torch
import torch.distributed as dist
from torch import nn

from recship.names import ShardingType
from recship.sparse import JaggedTensor, KeyedJaggedTensor
from recship.sparse.ids import check_id_dtype
from recship.trainer.distributed import sharded_state
from recship.trainer.distributed.sharders import EmbeddingBagCollectionSharder, EmbeddingCollectionSharder
from recship.trainer.distributed.types import ModuleSharder, ShardingEnv
from recship.trainer.managed_collisions.embedding import (BaseManagedCollisionEmbeddingCollection,
                                                          ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection,
                                                          managed_collision_plan_path)
from recship.trainer.managed_collisions.modules import ManagedCollisionCollection, ManagedCollisionModule, _features_in_order
from recship.trainer.planner.types import ParameterSharding

_ROW_BUFFERS = ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping")


def input_block_ranks(ids: torch.Tensor, input_size: int, buckets: int, world_size: int) -> torch.Tensor:
    """[N] int64: the rank whose managed-collision module remaps each raw id ([N] int64)."""
    block = (input_size + buckets - 1) // buckets
    per_rank = buckets // world_size
    in_range = torch.where(ids < block * buckets, ids // block, ids % buckets)
    return torch.div(in_range, per_rank, rounding_mode="floor")


def _row_shard(table: str, ps: ParameterSharding, rank: int, world_size: int) -> Tuple[int, int, List[int]]:
    """(first row, rows) of this rank's shard of ``table`` and the output segments (shard offsets + row count)."""
    if ShardingType(ps.sharding_type) != ShardingType.ROW_WISE:
        raise ValueError(f"table {table!r} has a managed-collision module: it must be sharded row_wise, "
                         f"the plan says {ShardingType(ps.sharding_type).value}")
    if sorted(s.rank for s in ps.shards) != list(range(world_size)):
        raise ValueError(f"table {table!r}: a row-wise managed-collision table needs one shard on each of the "
                         f"{world_size} ranks, the plan puts shards on ranks {[s.rank for s in ps.shards]}")
    mine = next(s for s in ps.shards if s.rank == rank)
    rows = sum(s.shard_sizes[0] for s in ps.shards)
    return mine.shard_offsets[0], mine.shard_sizes[0], [s.shard_offsets[0] for s in ps.shards] + [rows]


class ShardedManagedCollisionCollection(nn.Module):
    """This rank's part of a ManagedCollisionCollection: one module per table for this rank's rows.

    forward(features) takes this rank's KeyedJaggedTensor of raw ids (the whole step's batch is
    remapped together, a collective) and returns it with ids remapped to global rows, keys in the
    tables' order, as the unsharded collection does.

    Args:
        module: the unsharded collection (its modules are rebuilt per shard, their state not copied).
        plan: table name -> ParameterSharding (row-wise), the plan of the embedding collection.
        env: this rank and its process group.
        device: where the buffers live.
    """

    def __init__(self, module: ManagedCollisionCollection, plan: Dict[str, ParameterSharding], env: ShardingEnv,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("ShardedManagedCollisionCollection trains over a process group: torch.distributed.init_process_group first")
        self._env = env
        self._pg = env.pg
        self._device = torch.device(device or "cpu")
        # NCCL moves only CUDA tensors; gloo only CPU ones
        self._comm_device = self._device if dist.get_backend(self._pg) == "nccl" else torch.device("cpu")
        self._embedding_configs = module.embedding_configs()
        self._feature_names = list(module._feature_names)
        self._table_to_features = dict(module._table_to_features)
        self._table_to_offset: Dict[str, int] = {}
        self._plan: Dict[str, ParameterSharding] = {}
        modules: Dict[str, ManagedCollisionModule] = {}
        for table, mc in module._mc_modules().items():
            if table not in plan:
                raise ValueError(f"the sharding plan has no entry for table {table!r}")
            start, rows, segments = _row_shard(table, plan[table], env.rank, env.world_size)
            buckets = mc.buckets()
            if buckets < env.world_size or buckets % env.world_size:
                raise ValueError(f"table {table!r}: its managed-collision module has buckets={buckets}; sharded on "
                                 f"{env.world_size} ranks it needs a multiple of {env.world_size} (e.g. buckets={env.world_size})")
            modules[table] = mc.rebuild_with_output_id_range((start, start + rows), segments, device=self._device)
            self._table_to_offset[table] = start
            self._plan[table] = plan[table]
        self._managed_collision_modules = nn.ModuleDict(modules)
        self.train(module.training)
        self._register_state_dict_hook(ShardedManagedCollisionCollection._post_state_dict_hook)
        self._register_load_state_dict_pre_hook(self._pre_load_state_dict_hook, with_module=True)

    def embedding_configs(self) -> Any:
        return self._embedding_configs

    # -- forward -----------------------------------------------------------

    def _all_gather(self, t: torch.Tensor, sizes: List[int]) -> List[torch.Tensor]:
        """Each rank's ``t`` (of sizes[r] elements), padded to the largest and gathered."""
        longest = max(sizes)
        padded = torch.cat([t, t.new_zeros(longest - t.numel())])
        out = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(out, padded, group=self._pg)
        return [o[:n] for o, n in zip(out, sizes)]

    def forward(self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True) -> KeyedJaggedTensor:
        features = _features_in_order(features, self._feature_names)
        world, rank = self._env.world_size, self._env.rank
        check_id_dtype(features.values(), "sharded managed-collision input")  # before the cast: no float id truncates
        lengths = features.lengths().to(torch.int64)
        values = features.values().to(torch.int64)
        comm = self._comm_device
        counts = torch.tensor([lengths.numel(), values.numel()], dtype=torch.int64, device=comm)
        all_counts = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(all_counts, counts, group=self._pg)
        n_lengths = [int(c[0]) for c in all_counts]
        n_values = [int(c[1]) for c in all_counts]
        all_lengths = self._all_gather(lengths.to(comm), n_lengths)
        all_values = self._all_gather(values.to(comm), n_values)
        keys = features.keys()
        # per source rank: the [start, end) of each key's ids in its values
        spans: List[Dict[str, Tuple[int, int]]] = []
        for s in range(world):
            per_key = all_lengths[s].view(len(keys), -1).sum(1).tolist() if n_lengths[s] else [0] * len(keys)
            bounds, start = {}, 0
            for k, n in zip(keys, per_key):
                bounds[k] = (start, start + int(n))
                start += int(n)
            spans.append(bounds)
        flat_start = [sum(n_values[:s]) for s in range(world)]
        remapped = torch.zeros(sum(n_values), dtype=torch.int64, device=comm)
        for table, mc in self._mc_modules().items():
            ids, where = [], []
            for f in self._table_to_features[table]:
                for s in range(world):
                    a, b = spans[s][f]
                    ids.append(all_values[s][a:b])
                    where.append(torch.arange(flat_start[s] + a, flat_start[s] + b, device=comm))
            table_ids, table_where = torch.cat(ids), torch.cat(where)
            mine = input_block_ranks(table_ids, mc.input_size(), mc.buckets(), world) == rank
            local_ids = table_ids[mine].to(self._device)
            jt = JaggedTensor(values=local_ids, lengths=torch.tensor([local_ids.numel()], device=self._device))
            out = mc({table: jt}, mutate_miss_lengths=mutate_miss_lengths)[table].values()
            remapped[table_where[mine]] = out.to(comm)
        dist.all_reduce(remapped, group=self._pg)  # each id was remapped by one rank, zeros elsewhere
        own = remapped[flat_start[rank]: flat_start[rank] + n_values[rank]].to(features.values().device, features.values().dtype)
        return KeyedJaggedTensor(
            keys=keys,
            values=own,
            lengths=features.lengths(),
            weights=features.weights_or_none(),
            stride=features.stride(),
            inverse_indices=features.inverse_indices_or_none(),
        )

    def evict(self) -> Dict[str, Optional[torch.Tensor]]:
        """Table -> this shard's rows (local indices) whose slot changed hands since the last call."""
        out: Dict[str, Optional[torch.Tensor]] = {}
        for table, mc in self._mc_modules().items():
            rows = mc.evict()
            out[table] = None if rows is None else rows - self._table_to_offset[table]
        return out

    def open_slots(self) -> Dict[str, torch.Tensor]:
        return {table: mc.open_slots() for table, mc in self._mc_modules().items()}

    def _mc_modules(self) -> Dict[str, ManagedCollisionModule]:
        return {table: cast(ManagedCollisionModule, m) for table, m in self._managed_collision_modules.items()}

    # -- state -------------------------------------------------------------

    def _row_buffers(self, table: str) -> List[str]:
        mc = self._managed_collision_modules[table]
        return list(_ROW_BUFFERS) + ["_mch_" + name for name in getattr(mc, "_mch_metadata", {})]

    def _sharded(self, table: str, local: torch.Tensor) -> Any:
        ps = self._plan[table]
        rows = sum(s.shard_sizes[0] for s in ps.shards)
        md = [sharded_state.TorchShardMetadata([s.shard_offsets[0]], [s.shard_sizes[0]],
                                               sharded_state.placement(s, self._env.rank, self._device)) for s in ps.shards]
        mine = next(i for i, s in enumerate(ps.shards) if s.rank == self._env.rank)
        return sharded_state.make_sharded_tensor([(md[mine], local)], md, [rows], local.dtype, self._pg)

    @staticmethod
    def _post_state_dict_hook(module: "ShardedManagedCollisionCollection", destination: Dict[str, Any], prefix: str, _: Any) -> None:
        for table, mc in module._managed_collision_modules.items():
            for name in module._row_buffers(table):
                key = f"{prefix}_managed_collision_modules.{table}.{name}"
                if key in destination:
                    destination[key] = module._sharded(table, getattr(mc, name))

    @staticmethod
    def _pre_load_state_dict_hook(module: "ShardedManagedCollisionCollection", state_dict: Dict[str, Any], prefix: str, *_: Any) -> None:
        """A ShardedTensor loads its local shard; a plain tensor must already be this rank's size (a whole unsharded
        state cannot be split by rows: its slots are not grouped by input block)."""
        for table, mc in module._managed_collision_modules.items():
            for name in module._row_buffers(table):
                key = f"{prefix}_managed_collision_modules.{table}.{name}"
                value = state_dict.get(key)
                if value is None:
                    continue
                if not hasattr(value, "local_shards"):
                    local = getattr(mc, name)
                    if value.shape != local.shape:
                        raise ValueError(f"{key}: a tensor of shape {list(value.shape)} for this rank's {list(local.shape)} rows: "
                                         "load the sharded state this collection saved (an unsharded one cannot be re-split)")
                    continue
                shards = value.local_shards()
                if len(shards) != 1:
                    raise ValueError(f"{key}: expected one local shard on rank {module._env.rank}, got {len(shards)}")
                state_dict[key] = shards[0].tensor


class ManagedCollisionCollectionSharder(ModuleSharder[ManagedCollisionCollection]):
    """Shards a ManagedCollisionCollection row-wise (under its embedding collection's plan)."""

    def __init__(self, qcomm_codecs_registry: Optional[Dict[str, Any]] = None) -> None:
        if qcomm_codecs_registry is not None:
            raise ValueError("ManagedCollisionCollectionSharder: recship has no quantized communication (qcomm_codecs_registry)")

    @property
    def module_type(self) -> Type[ManagedCollisionCollection]:
        return ManagedCollisionCollection

    def shard(self, module: ManagedCollisionCollection, params: Dict[str, Any], env: ShardingEnv,
              device: Optional[torch.device] = None) -> nn.Module:
        return ShardedManagedCollisionCollection(module, params, env, device)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [ShardingType.ROW_WISE.value]


class BaseShardedManagedCollisionEmbeddingCollection(BaseManagedCollisionEmbeddingCollection):
    """A managed-collision embedding collection sharded for training (TorchRec's
    ``torchrec.distributed.mc_embedding_modules.BaseShardedManagedCollisionEmbeddingCollection``, the base of its
    sharded MC-EBC and MC-EC): ``module``'s embedding collection sharded by ``e_sharder`` under
    ``table_name_to_parameter_sharding`` (row-wise), its ManagedCollisionCollection by ``mc_sharder`` (each rank's
    modules own its rows), so that forward(kjt) remaps this rank's raw ids (a collective) and looks them up in the
    sharded tables, returning (the lookup's output, the remapped KJT or None) as the unsharded module does.

    ``module`` itself is left unsharded (its managed-collision collection is shared until sharded here). State-dict
    keys are the unsharded module's (``_embedding_module.*``, ``_managed_collision_collection.*``), the rows'
    entries ShardedTensors. What DistributedModelParallel builds is the unsharded module with both parts sharded in
    place: the same forward and state.
    """

    def __init__(
        self,
        module: BaseManagedCollisionEmbeddingCollection,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        e_sharder: ModuleSharder,
        mc_sharder: ManagedCollisionCollectionSharder,
        env: ShardingEnv,
        device: Optional[torch.device],
    ) -> None:
        if not isinstance(module, BaseManagedCollisionEmbeddingCollection):
            raise TypeError(f"{type(self).__name__} shards a managed-collision embedding collection, got {type(module).__name__}")
        if not isinstance(module._managed_collision_collection, ManagedCollisionCollection):
            raise ValueError(f"this {type(module).__name__} is sharded already")
        wanted = EmbeddingBagCollectionSharder if isinstance(module, ManagedCollisionEmbeddingBagCollection) else EmbeddingCollectionSharder
        if not isinstance(e_sharder, wanted):
            raise TypeError(f"{type(module).__name__}'s tables are sharded by a {wanted.__name__}, got {type(e_sharder).__name__}")
        super().__init__(module._embedding_module, module._managed_collision_collection,  # type: ignore[arg-type]
                         module._return_remapped_features, module._allow_in_place_embed_weight_update)
        self._env = env
        self._device = device
        # the sharder's kind matches the collection's (checked above); mypy sees the two as unrelated unions
        self._embedding_module = e_sharder.shard(module._embedding_module, table_name_to_parameter_sharding, env, device)  # type: ignore[arg-type,assignment]
        shard_managed_collision_collection(self, table_name_to_parameter_sharding, env, device, mc_sharder)
        self.train(module.training)


class ShardedManagedCollisionEmbeddingBagCollection(BaseShardedManagedCollisionEmbeddingCollection):
    """A ManagedCollisionEmbeddingBagCollection sharded for training (ManagedCollisionEmbeddingBagCollectionSharder's)."""

    @property
    def _embedding_bag_collection(self) -> nn.Module:
        return self._embedding_module


class ShardedManagedCollisionEmbeddingCollection(BaseShardedManagedCollisionEmbeddingCollection):
    """A ManagedCollisionEmbeddingCollection sharded for training (ManagedCollisionEmbeddingCollectionSharder's)."""

    @property
    def _embedding_collection(self) -> nn.Module:
        return self._embedding_module


class _ManagedCollisionSharder(ModuleSharder[Any]):
    """What the two managed-collision embedding sharders share: the inner collection's sharder, and ours."""

    _kind: Type[BaseManagedCollisionEmbeddingCollection]

    def __init__(self, e_sharder: ModuleSharder, mc_sharder: Optional[ManagedCollisionCollectionSharder],
                 qcomm_codecs_registry: Optional[Dict[str, Any]]) -> None:
        if qcomm_codecs_registry is not None:
            raise ValueError(f"{type(self).__name__}: recship has no quantized communication (qcomm_codecs_registry)")
        self._e_sharder = e_sharder
        self._mc_sharder = mc_sharder or ManagedCollisionCollectionSharder()

    @property
    def module_type(self) -> Type[Any]:
        return self._kind

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [ShardingType.ROW_WISE.value]

    def shardable_parameters(self, module: BaseManagedCollisionEmbeddingCollection) -> Dict[str, nn.Parameter]:
        return self._e_sharder.shardable_parameters(module._embedding_module)  # type: ignore[attr-defined]

    def shard(self, module: Any, params: Dict[str, Any], env: ShardingEnv, device: Optional[torch.device] = None) -> nn.Module:
        """``module`` with its embedding collection and its managed-collision collection sharded (collectives): a
        ShardedManagedCollisionEmbeddingBagCollection / ShardedManagedCollisionEmbeddingCollection."""
        if not isinstance(module, self._kind):
            raise TypeError(f"{type(self).__name__} shards {self._kind.__name__}, got {type(module).__name__}")
        sharded = (ShardedManagedCollisionEmbeddingBagCollection if isinstance(module, ManagedCollisionEmbeddingBagCollection)
                   else ShardedManagedCollisionEmbeddingCollection)
        return sharded(module, params, self._e_sharder, self._mc_sharder, env, device)


def shard_managed_collision_collection(module: nn.Module, params: Dict[str, Any], env: ShardingEnv,
                                       device: Optional[torch.device] = None,
                                       mc_sharder: Optional[ManagedCollisionCollectionSharder] = None) -> None:
    """Replaces ``module``'s ManagedCollisionCollection by its row-wise sharded form under ``params`` (the plan of
    ``module``'s embedding collection, already sharded); what DistributedModelParallel calls. On a world of one
    rank the collection stays as it is."""
    if not isinstance(module, BaseManagedCollisionEmbeddingCollection):
        raise TypeError(f"shard_managed_collision_collection takes a managed-collision embedding collection, got {type(module).__name__}")
    mcc = module._managed_collision_collection
    if not isinstance(mcc, ManagedCollisionCollection):
        raise ValueError("this managed-collision collection is sharded already")
    if env.world_size == 1:  # one rank sees every id: the unsharded collection is exact, whatever the tables' plan
        return
    module._managed_collision_collection = (mc_sharder or ManagedCollisionCollectionSharder()).shard(mcc, params, env, device)  # type: ignore[assignment]


class ManagedCollisionEmbeddingBagCollectionSharder(_ManagedCollisionSharder):
    """Shards a ManagedCollisionEmbeddingBagCollection: its tables row-wise with ``ebc_sharder`` (whose
    ``fused_params`` set the fused optimizer) and its managed-collision modules with ``mc_sharder``."""

    _kind = ManagedCollisionEmbeddingBagCollection

    def __init__(self, ebc_sharder: Optional[EmbeddingBagCollectionSharder] = None,
                 mc_sharder: Optional[ManagedCollisionCollectionSharder] = None,
                 fused_params: Optional[Dict[str, Any]] = None, qcomm_codecs_registry: Optional[Dict[str, Any]] = None) -> None:
        if ebc_sharder is not None and not isinstance(ebc_sharder, EmbeddingBagCollectionSharder):
            raise TypeError(f"ebc_sharder must be an EmbeddingBagCollectionSharder, got {type(ebc_sharder).__name__}")
        super().__init__(ebc_sharder or EmbeddingBagCollectionSharder(fused_params=fused_params), mc_sharder, qcomm_codecs_registry)

    @property
    def ebc_sharder(self) -> EmbeddingBagCollectionSharder:
        """The inner collection's sharder (the planner plans, and DistributedModelParallel shards, with it)."""
        assert isinstance(self._e_sharder, EmbeddingBagCollectionSharder)
        return self._e_sharder


class ManagedCollisionEmbeddingCollectionSharder(_ManagedCollisionSharder):
    """Shards a ManagedCollisionEmbeddingCollection: its tables row-wise with ``ec_sharder``, its
    managed-collision modules with ``mc_sharder``."""

    _kind = ManagedCollisionEmbeddingCollection

    def __init__(self, ec_sharder: Optional[EmbeddingCollectionSharder] = None,
                 mc_sharder: Optional[ManagedCollisionCollectionSharder] = None,
                 fused_params: Optional[Dict[str, Any]] = None, qcomm_codecs_registry: Optional[Dict[str, Any]] = None) -> None:
        if ec_sharder is not None and not isinstance(ec_sharder, EmbeddingCollectionSharder):
            raise TypeError(f"ec_sharder must be an EmbeddingCollectionSharder, got {type(ec_sharder).__name__}")
        super().__init__(ec_sharder or EmbeddingCollectionSharder(fused_params=fused_params), mc_sharder, qcomm_codecs_registry)


def per_rank_buffers(module: nn.Module) -> List[str]:
    """Names of the sharded managed-collision buffers in ``module`` (each rank's own: DDP must not broadcast them)."""
    return [f"{path}.{name}" if path else name
            for path, sub in module.named_modules() if isinstance(sub, ShardedManagedCollisionCollection)
            for name, _ in sub.named_buffers()]
