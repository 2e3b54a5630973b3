"""TorchRec's inference sharders (``torchrec.distributed.quant_embeddingbag`` / ``quant_embedding``) on recship's
inference sharding (``recship.quantize.sharded``):

    sharded = _shard_modules(quant_model, env=ShardingEnv.from_local(2, 0), device=torch.device("cpu"), plan=plan,
                             sharders=[QuantEmbeddingBagCollectionSharder(), QuantFeatureProcessedEmbeddingBagCollectionSharder()])

Each sharder names the quantized collection type it shards and shards one collection as a ShardingPlan's entry for
it says (table-, row- or column-wise blocks on ranks; ``None``: each table whole on the least-loaded rank). One process
drives every rank's device, as TorchRec's inference sharding does. Row blocks hold the stored rows as they are, so a
sharded collection answers what the unsharded one does; an integer table's rows cannot be split by columns after
quantization (one scale per row), so column-wise sharding of INT8/INT4/INT2 tables is a ValueError.

``fused_params`` takes TorchRec's inference keys: ``FUSED_PARAM_REGISTER_TBE_BOOL`` and
``FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS`` choose the sharded tables' state_dict layout;
``FUSED_PARAM_BOUNDS_CHECK_MODE`` and ``FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP`` change nothing (recship checks every
id against its table before any block sees it, whatever the mode). Any other key is a ValueError.
"""

from typing import Any, Dict, Generic, List, Optional, Tuple, Type, TypeVar, Union, cast

from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
import torch
from torch import nn

from recship.names import EmbeddingComputeKernel, ShardingType
from recship.quantize.feature_processed import QuantFeatureProcessedEmbeddingBagCollection
from recship.quantize.managed_collisions import (ManagedCollisionLookup, QuantManagedCollisionEmbeddingBagCollection,
                                                 QuantManagedCollisionEmbeddingCollection)
from recship.quantize.modules import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from recship.quantize.sharded import (InferenceShard, ShardedQuantEmbeddingBagCollection, local_devices, plan_inference_shards,
                                     shard_collection, shard_modules)
from recship.quantize.tbe import QuantTables
from recship.trainer.distributed.types import (FUSED_PARAM_BOUNDS_CHECK_MODE, FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP,
                                               FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS, FUSED_PARAM_REGISTER_TBE_BOOL,
                                               ModuleSharder, ShardingEnv)
from recship.trainer.distributed.mc_sharder import ManagedCollisionCollectionSharder
from recship.modules.embedding_configs import EmbeddingBagConfig
from recship.trainer.managed_collisions.modules import ManagedCollisionCollection
from recship.trainer.planner.types import ParameterConstraints, ParameterSharding, ShardingPlan, ShardMetadata

# TorchRec's fused_params keys (torchrec.distributed.fused_params) that its inference sharders read
FUSED_PARAMS = (FUSED_PARAM_REGISTER_TBE_BOOL, FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS, FUSED_PARAM_BOUNDS_CHECK_MODE,
                FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP)
INFERENCE_SHARDING_TYPES = [ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value, ShardingType.COLUMN_WISE.value]

Q = TypeVar("Q", bound=nn.Module)


class BaseQuantEmbeddingSharder(ModuleSharder[Q], Generic[Q]):
    """What TorchRec's inference sharders share: ``fused_params`` (TorchRec's inference keys, see the module
    docstring) and ``shardable_params`` (table names; None: all. recship shards every table of a collection:
    a list that leaves some out is a ValueError at shard time)."""

    def __init__(self, fused_params: Optional[Dict[str, Any]] = None, shardable_params: Optional[List[str]] = None) -> None:
        unknown = sorted(set(fused_params or {}) - set(FUSED_PARAMS))
        if unknown:
            raise ValueError(f"{type(self).__name__}: fused_params keys {unknown} are not taken; inference sharding takes {list(FUSED_PARAMS)}")
        self._fused_params: Optional[Dict[str, Any]] = dict(fused_params) if fused_params is not None else None
        self._shardable_params: List[str] = list(shardable_params or [])

    @property
    def fused_params(self) -> Optional[Dict[str, Any]]:
        return self._fused_params

    def shardable_parameters(self, module: nn.Module) -> Dict[str, nn.Module]:
        """table name -> its rows' holder (``embedding_bags.<t>`` / ``embeddings.<t>``), those ``shardable_params`` names."""
        holders = dict(getattr(module, "embedding_bags", None) or getattr(module, "embeddings", None) or {})
        return {n: h for n, h in holders.items() if not self._shardable_params or n in self._shardable_params}

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(INFERENCE_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return ["quant"]

    def _check_shardable(self, module: nn.Module) -> None:
        tables = [t.name for t in module.tables()] if isinstance(module, QuantTables) else []
        left = [t for t in tables if self._shardable_params and t not in self._shardable_params]
        if left:
            raise ValueError(f"{type(self).__name__}: shardable_params leaves tables {left} out; recship shards every table "
                             "of a quantized collection")

    def _layout(self, sharded: nn.Module) -> nn.Module:
        """``sharded``'s tables in the state_dict layout ``fused_params`` asks for."""
        params = self._fused_params or {}
        split, register = bool(params.get(FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS)), bool(params.get(FUSED_PARAM_REGISTER_TBE_BOOL))
        if split or register:
            for m in sharded.modules():
                if isinstance(m, QuantEmbeddingBagCollection):
                    m.set_state_dict_layout(split_scale_bias=split, register_tbes=register)
        return sharded


class QuantEmbeddingBagCollectionSharder(BaseQuantEmbeddingSharder[QuantEmbeddingBagCollection]):
    """Shards QuantEmbeddingBagCollections for inference: ``shard`` -> ShardedQuantEmbeddingBagCollection."""

    @property
    def module_type(self) -> Type[QuantEmbeddingBagCollection]:
        return QuantEmbeddingBagCollection

    def shard(self, module: QuantEmbeddingBagCollection, params: Optional[Dict[str, ParameterSharding]], env: ShardingEnv,
              device: Union[None, str, torch.device] = None, module_fqn: Optional[str] = None) -> nn.Module:
        """``module`` over ``env.world_size`` local devices of ``device``'s type (None: CPU), as ``params``
        (table -> ParameterSharding) places its tables."""
        self._check_shardable(module)
        return self._layout(shard_collection(module_fqn or "", module, params, local_devices(int(env.world_size), device or "cpu")))


class QuantFeatureProcessedEmbeddingBagCollectionSharder(BaseQuantEmbeddingSharder[QuantFeatureProcessedEmbeddingBagCollection]):
    """Shards QuantFeatureProcessedEmbeddingBagCollections: their tables as QuantEmbeddingBagCollectionSharder
    does, their feature processors (float, small) kept whole in front of the sharded lookup."""

    @property
    def module_type(self) -> Type[QuantFeatureProcessedEmbeddingBagCollection]:
        return QuantFeatureProcessedEmbeddingBagCollection

    def shard(self, module: QuantFeatureProcessedEmbeddingBagCollection, params: Optional[Dict[str, ParameterSharding]],
              env: ShardingEnv, device: Union[None, str, torch.device] = None, module_fqn: Optional[str] = None) -> nn.Module:
        self._check_shardable(module)
        return self._layout(shard_collection(module_fqn or "", module, params, local_devices(int(env.world_size), device or "cpu")))


class QuantEmbeddingCollectionSharder(BaseQuantEmbeddingSharder[QuantEmbeddingCollection]):
    """Places QuantEmbeddingCollections (unpooled lookups) for inference: recship keeps such a collection whole, so
    every table of it must be table-wise on one rank; the collection moves to that rank's device."""

    @property
    def module_type(self) -> Type[QuantEmbeddingCollection]:
        return QuantEmbeddingCollection

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [ShardingType.TABLE_WISE.value]

    def shard(self, module: QuantEmbeddingCollection, params: Optional[Dict[str, ParameterSharding]], env: ShardingEnv,
              device: Union[None, str, torch.device] = None, module_fqn: Optional[str] = None) -> nn.Module:
        self._check_shardable(module)
        devices = local_devices(int(env.world_size), device or "cpu")
        ranks = {0} if params is None else {r for p in params.values() for r in (p.ranks or [0])}
        kinds = {ShardingType(p.sharding_type) for p in (params or {}).values()}
        if len(ranks) != 1 or kinds - {ShardingType.TABLE_WISE}:
            raise ValueError(f"QuantEmbeddingCollectionSharder: {module_fqn or 'the collection'} stays whole on one rank; "
                             f"its plan puts tables {sorted(k.value for k in kinds)} on ranks {sorted(ranks)}")
        return module.to(devices[next(iter(ranks))])




class InferManagedCollisionCollectionSharder(ManagedCollisionCollectionSharder):
    """Places a quantized collection's ManagedCollisionCollection for inference (TorchRec's
    ``torchrec.distributed.mc_modules.InferManagedCollisionCollectionSharder``).

    TorchRec splits it row-wise with its tables, one slice of slots per rank, each rank remapping the ids of its
    input block. recship's inference sharding is one process driving every device: it sees every id, so the
    collection stays whole, on the first device, and remaps exactly as the unsharded module does, whatever the
    tables' sharding (hence every inference sharding type; TorchRec's is row-wise only).
    """

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(INFERENCE_SHARDING_TYPES)

    def shard(self, module: ManagedCollisionCollection, params: Dict[str, Any], env: ShardingEnv,  # type: ignore[override]
              embedding_shardings: Optional[List[Any]] = None, device: Union[None, str, torch.device] = None) -> ManagedCollisionCollection:
        """``module`` (whole) on the first of the ``env.world_size`` local devices of ``device``'s type (None: CPU).
        ``embedding_shardings`` is TorchRec's argument (its tables' shardings); recship's remapping needs none."""
        if not isinstance(module, ManagedCollisionCollection):
            raise TypeError(f"InferManagedCollisionCollectionSharder shards a ManagedCollisionCollection, got {type(module).__name__}")
        target = torch.device(device or "cpu")
        return module.to(target if target.index is not None else local_devices(int(env.world_size), target)[0])


class _QuantManagedCollisionSharder(BaseQuantEmbeddingSharder[Q], Generic[Q]):
    """What the two quantized managed-collision sharders share: the tables go as ``e_sharder`` places them, the
    managed-collision collection as ``mc_sharder`` does (whole, in front; see InferManagedCollisionCollectionSharder)."""

    _e_kind: Type[BaseQuantEmbeddingSharder]

    def __init__(self, e_sharder: BaseQuantEmbeddingSharder, mc_sharder: InferManagedCollisionCollectionSharder) -> None:
        if not isinstance(e_sharder, self._e_kind):
            raise TypeError(f"{type(self).__name__}: e_sharder must be a {self._e_kind.__name__}, got {type(e_sharder).__name__}")
        if not isinstance(mc_sharder, InferManagedCollisionCollectionSharder):
            raise TypeError(f"{type(self).__name__}: mc_sharder must be an InferManagedCollisionCollectionSharder, "
                            f"got {type(mc_sharder).__name__}")
        super().__init__(e_sharder.fused_params)
        self._e_sharder = e_sharder
        self._mc_sharder = mc_sharder

    @property
    def fused_params(self) -> Optional[Dict[str, Any]]:
        return self._e_sharder.fused_params

    def shardable_parameters(self, module: nn.Module) -> Dict[str, nn.Module]:
        return self._e_sharder.shardable_parameters(module)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        mc = set(self._mc_sharder.sharding_types(compute_device_type))
        return [t for t in self._e_sharder.sharding_types(compute_device_type) if t in mc]

    def _check(self, module: nn.Module, params: Optional[Dict[str, ParameterSharding]], compute_device_type: str) -> None:
        if not isinstance(module, self.module_type):
            raise TypeError(f"{type(self).__name__} shards {self.module_type.__name__}, got {type(module).__name__}")
        allowed = self.sharding_types(compute_device_type)
        bad = {t: ShardingType(p.sharding_type).value for t, p in (params or {}).items() if ShardingType(p.sharding_type).value not in allowed}
        if bad:
            raise ValueError(f"{type(self).__name__}: tables {bad} are planned with sharding types it does not take {allowed}")


class QuantManagedCollisionEmbeddingCollectionSharder(_QuantManagedCollisionSharder[QuantManagedCollisionEmbeddingCollection]):
    """Places QuantManagedCollisionEmbeddingCollections for inference (TorchRec's sharder of that name): the unpooled
    tables stay whole on one rank (as QuantEmbeddingCollectionSharder keeps them), the managed-collision collection
    with them; the module answers what it answered unsharded."""

    _e_kind = QuantEmbeddingCollectionSharder

    @property
    def module_type(self) -> Type[QuantManagedCollisionEmbeddingCollection]:
        return QuantManagedCollisionEmbeddingCollection

    def shard(self, module: QuantManagedCollisionEmbeddingCollection, params: Optional[Dict[str, ParameterSharding]],
              env: ShardingEnv, device: Union[None, str, torch.device] = None, module_fqn: Optional[str] = None) -> nn.Module:
        self._check(module, params, torch.device(device or "cpu").type)
        e_sharder = self._e_sharder
        assert isinstance(e_sharder, QuantEmbeddingCollectionSharder)  # checked by __init__ (_e_kind)
        placed = e_sharder.shard(module, params, env, device, module_fqn=module_fqn)
        assert isinstance(placed, QuantManagedCollisionEmbeddingCollection)  # the EC sharder moves the module as a whole
        tables_on = next(iter(placed.table_weights().values()))[0].device  # the remapped ids go straight to them
        placed._managed_collision_collection = self._mc_sharder.shard(module._managed_collision_collection, params or {}, env,
                                                                      device=tables_on)
        return placed


class QuantManagedCollisionEmbeddingBagCollectionSharder(_QuantManagedCollisionSharder[QuantManagedCollisionEmbeddingBagCollection]):
    """Shards QuantManagedCollisionEmbeddingBagCollections for inference (TorchRec's sharder of that name): the tables
    table-, row- or column-wise as QuantEmbeddingBagCollectionSharder shards them, the managed-collision collection
    whole in front (a ManagedCollisionLookup: KJT of raw ids in, (KeyedTensor, remapped KJT) out)."""

    _e_kind = QuantEmbeddingBagCollectionSharder

    @property
    def module_type(self) -> Type[QuantManagedCollisionEmbeddingBagCollection]:
        return QuantManagedCollisionEmbeddingBagCollection

    def shard(self, module: QuantManagedCollisionEmbeddingBagCollection, params: Optional[Dict[str, ParameterSharding]],
              env: ShardingEnv, device: Union[None, str, torch.device] = None, module_fqn: Optional[str] = None) -> nn.Module:
        self._check(module, params, torch.device(device or "cpu").type)
        e_sharder = self._e_sharder
        assert isinstance(e_sharder, QuantEmbeddingBagCollectionSharder)  # checked by __init__ (_e_kind)
        placed = e_sharder.shard(module, params, env, device, module_fqn=module_fqn)
        assert isinstance(placed, ManagedCollisionLookup)  # shard_collection puts the remapping in front
        placed._managed_collision_collection = self._mc_sharder.shard(module._managed_collision_collection, params or {}, env,
                                                                      device=device)
        return placed


# TorchRec's defaults for inference sharding (torchrec.inference.modules); BoundsCheckMode.NONE is TorchRec's value,
# read as "no check of its own": recship checks ids before the TBEs whatever it says
def _default_fused_params() -> Dict[str, Any]:
    return {FUSED_PARAM_REGISTER_TBE_BOOL: True, FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS: True,
            FUSED_PARAM_BOUNDS_CHECK_MODE: BoundsCheckMode.NONE, FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP: False}


def default_sharders() -> List[ModuleSharder]:
    """TorchRec's DEFAULT_SHARDERS: the three inference sharders with TorchRec's default fused_params."""
    params = _default_fused_params()
    return [QuantEmbeddingBagCollectionSharder(fused_params=params), QuantEmbeddingCollectionSharder(fused_params=params),
            QuantFeatureProcessedEmbeddingBagCollectionSharder(fused_params=params)]


def shard_quant_model(
    model: nn.Module,
    world_size: int = 1,
    compute_device: str = "cuda",
    sharding_device: str = "meta",
    sharders: Optional[List[ModuleSharder]] = None,
    device_memory_size: Optional[int] = None,
    constraints: Optional[Dict[str, ParameterConstraints]] = None,
    ddr_cap: Optional[int] = None,
    sharding_plan: Optional[ShardingPlan] = None,
) -> Tuple[nn.Module, ShardingPlan]:
    """TorchRec's ``shard_quant_model``: inference sharding, in place, of a quantized model over ``world_size``
    devices of ``compute_device`` ("cuda": cuda:0..; "cpu": host-memory shards); returns (the model, its plan).

    ``sharding_plan`` places the tables as given. Otherwise each table of a collection the ``sharders`` (default:
    ``default_sharders()``) take goes as the first of its ``constraints``' sharding types (table_wise, row_wise,
    column_wise; default table-wise), table-wise tables on the least-loaded device; a table-wise table larger than
    a device's capacity (``device_memory_size`` on CUDA, ``ddr_cap`` on the CPU, in bytes) is split row-wise, and
    one that does not fit at all is a ValueError. ``sharding_device`` (where TorchRec builds the sharded modules
    before moving them) changes nothing here: the shards are built where they run, their rows copied.
    """
    if compute_device not in ("cuda", "cpu"):
        raise ValueError(f"shard_quant_model: compute_device must be cuda or cpu, got {compute_device!r}")
    sharders = list(sharders) if sharders else default_sharders()
    if sharding_plan is None:
        capacity = device_memory_size if compute_device == "cuda" else ddr_cap
        sharding_plan = _plan(model, world_size, compute_device, sharders, constraints or {}, capacity)
    sharded = shard_modules(model, env=ShardingEnv.from_local(world_size, 0), device=compute_device, plan=sharding_plan,
                            sharders=sharders)
    return sharded, sharding_plan


def _plan(model: nn.Module, world_size: int, compute_device: str, sharders: List[ModuleSharder],
          constraints: Dict[str, ParameterConstraints], capacity: Optional[int]) -> ShardingPlan:
    """A ShardingPlan of every collection the ``sharders`` take (see ``shard_quant_model``)."""
    types = tuple(s.module_type for s in sharders)
    plan: Dict[str, Dict[str, ParameterSharding]] = {}
    for path, m in model.named_modules():
        if type(m) not in types:
            continue
        assert isinstance(m, QuantTables)  # the sharders' module types are recship's quantized collections
        tables = m.tables()
        kinds: Dict[str, ShardingType] = {}
        for t in tables:
            allowed = constraints[t.name].sharding_types if t.name in constraints else None
            if allowed:
                kinds[t.name] = ShardingType(allowed[0])
        if isinstance(m, QuantEmbeddingCollection):
            placed = {t.name: [InferenceShard(t.name, 0, 0, 0, t.num_embeddings, 0, t.embedding_dim)] for t in tables}
        else:
            stored = {name: int(data.numel()) + (0 if sb is None else int(sb.numel())) for name, (data, sb) in m.table_weights().items()}
            placed = plan_inference_shards(cast(List[EmbeddingBagConfig], tables), world_size, kinds, stored, capacity)
        plan[path] = {name: _parameter_sharding(shards, compute_device) for name, shards in placed.items()}
    return ShardingPlan(plan)


def _parameter_sharding(shards: List[InferenceShard], compute_device: str) -> ParameterSharding:
    """The plan's entry for one table's shards: one block: table-wise; blocks side by side: column-wise; else row-wise."""
    kind = (ShardingType.TABLE_WISE if len(shards) == 1 else ShardingType.COLUMN_WISE
            if len({s.col_offset for s in shards}) > 1 else ShardingType.ROW_WISE)
    return ParameterSharding(kind, EmbeddingComputeKernel.QUANT, [s.device for s in shards], [
        ShardMetadata([s.row_offset, s.col_offset], [s.rows, s.cols], s.device,
                      "cpu" if compute_device == "cpu" else f"cuda:{s.device}") for s in shards])


__all__ = ["BaseQuantEmbeddingSharder", "InferManagedCollisionCollectionSharder", "QuantEmbeddingBagCollectionSharder",
           "QuantEmbeddingCollectionSharder", "QuantManagedCollisionEmbeddingBagCollectionSharder",
           "QuantManagedCollisionEmbeddingCollectionSharder",
           "QuantFeatureProcessedEmbeddingBagCollectionSharder", "ShardedQuantEmbeddingBagCollection", "default_sharders",
           "shard_quant_model"]
