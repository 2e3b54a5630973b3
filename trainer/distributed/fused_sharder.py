"""TorchRec's FusedEmbeddingBagCollectionSharder (``torchrec.distributed.fused_embeddingbag``): shards a
FusedEmbeddingBagCollection (``recship.trainer.fused_embedding_modules``) under DistributedModelParallel as an
EmbeddingBagCollection is sharded, its tables trained by the module's own fused optimizer.

    fused = FusedEmbeddingBagCollection(tables, torch.optim.SGD, {"lr": 0.1})
    model = DistributedModelParallel(Model(fused), plan=plan, sharders=[FusedEmbeddingBagCollectionSharder()])

The sharded module is a ShardedFusedEmbeddingBagCollection: a ShardedEmbeddingBagCollection whose fused optimizer
is the one the FusedEmbeddingBagCollection was built with (its optimizer class and arguments, converted as
``convert_optimizer_type_and_kwargs`` does), its shards filled with the module's current weights. Its outputs,
state_dict keys (``embedding_bags.<table>.weight``) and training are the sharded EmbeddingBagCollection's, so N ranks
train as one process on the whole batch with a mean loss.

Where recship differs from TorchRec: data-parallel tables are refused (recship's data-parallel tables are dense
parameters, trained by the dense optimizer; TorchRec registers the fused optimizer on their DDP, an optimizer its
checkpoints do not save), and row-wise / table-row-wise sharding is offered on the CPU too (recship's sharded
collections run them on gloo). ``fused_params`` must stay empty: the module's own optimizer trains its tables.
"""

from typing import Any, Dict, List, Mapping, Optional, Type

import torch
from torch import nn

from recship.names import EmbeddingComputeKernel, ShardingType
from recship.trainer.distributed.sharded_ebc import ShardedEmbeddingBagCollection
from recship.trainer.distributed.sharders import BaseEmbeddingSharder, check_training_kernel
from recship.trainer.distributed.types import ShardingEnv
from recship.modules.embedding_modules import EmbeddingBagCollection
from recship.trainer.fused_embedding_modules import FusedEmbeddingBagCollection, _kernel_config
from recship.trainer.planner.types import ParameterSharding

# the types a fused collection shards with: every sharded type of recship's ShardedEmbeddingBagCollection
FUSED_EBC_SHARDING_TYPES = [ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE,
                            ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE]


def _as_ebc(module: FusedEmbeddingBagCollection) -> EmbeddingBagCollection:
    """An EmbeddingBagCollection of ``module``'s tables whose weights are ``module``'s (views, nothing copied), for
    ShardedEmbeddingBagCollection to copy its shards from."""
    ebc = EmbeddingBagCollection(module.embedding_bag_configs(), is_weighted=module.is_weighted(), device=torch.device("meta"))
    for t in module.embedding_bag_configs():
        ebc.embedding_bags[t.name].weight = nn.Parameter(_table_weight(module, t.name).detach(), requires_grad=False)
    return ebc


def _table_weight(module: FusedEmbeddingBagCollection, table: str) -> nn.Parameter:
    """The registered weight of ``table``: a parameter viewing the kernel's rows."""
    weight = module.embedding_bags[table].weight
    assert isinstance(weight, nn.Parameter)  # registered by FusedEmbeddingBagCollection._build
    return weight


class ShardedFusedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """The shard of a FusedEmbeddingBagCollection this rank owns (TorchRec's constructor).

    Args:
        module: the FusedEmbeddingBagCollection; its optimizer becomes the shards' fused optimizer and its weights
            are copied into them.
        table_name_to_parameter_sharding: table name -> ParameterSharding (every table sharded, none data-parallel),
            identical on every rank.
        env: the ShardingEnv (its process group).
        device: where this rank's shards live (default cpu).
        qcomm_codecs_registry: TorchRec's quantized communication: refused (recship sends fp32).
    """

    def __init__(
        self,
        module: FusedEmbeddingBagCollection,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
    ) -> None:
        if not isinstance(module, FusedEmbeddingBagCollection):
            raise TypeError(f"ShardedFusedEmbeddingBagCollection shards a FusedEmbeddingBagCollection, got {type(module).__name__}")
        replicated = sorted(n for n, ps in table_name_to_parameter_sharding.items() if ps.sharding_type == ShardingType.DATA_PARALLEL)
        if replicated:
            raise ValueError(f"tables {replicated} of a FusedEmbeddingBagCollection are planned data_parallel: recship trains "
                             "data-parallel tables with the dense optimizer, not the module's fused one; shard them "
                             f"({', '.join(st.value for st in FUSED_EBC_SHARDING_TYPES)})")
        optimizer = _kernel_config(module.optimizer_type(), module.optimizer_kwargs(), torch.device(device or "cpu"))
        super().__init__(_as_ebc(module), table_name_to_parameter_sharding, env, optimizer, device,
                         qcomm_codecs_registry=qcomm_codecs_registry)

    def _get_name(self) -> str:
        return "ShardedFusedEmbeddingBagCollection"


class FusedEmbeddingBagCollectionSharder(BaseEmbeddingSharder[FusedEmbeddingBagCollection]):
    """Shards FusedEmbeddingBagCollections (TorchRec's constructor: BaseEmbeddingSharder's).

    Args:
        fused_params: must be None or empty: the module's own optimizer trains its tables.
        qcomm_codecs_registry, sharded_module_order_overwrite: refused as by every recship sharder.
    """

    def __init__(self, fused_params: Optional[Mapping[str, Any]] = None, qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
                 sharded_module_order_overwrite: Optional[List[Any]] = None) -> None:
        if fused_params:
            raise ValueError(f"FusedEmbeddingBagCollectionSharder(fused_params={dict(fused_params)!r}): a "
                             "FusedEmbeddingBagCollection's tables train with its own optimizer; pass no fused_params")
        super().__init__(None, qcomm_codecs_registry, sharded_module_order_overwrite)

    @property
    def module_type(self) -> Type[FusedEmbeddingBagCollection]:
        return FusedEmbeddingBagCollection

    def shard(  # type: ignore[override]
        self,
        module: FusedEmbeddingBagCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> ShardedEmbeddingBagCollection:
        """The ShardedFusedEmbeddingBagCollection for this rank of ``env`` (which needs a process group)."""
        for name, ps in params.items():
            if ps.sharding_type != ShardingType.DATA_PARALLEL:  # data-parallel: refused by the sharded module, by name
                check_training_kernel(name, ps)
        return ShardedFusedEmbeddingBagCollection(module, params, env, device)

    def shardable_parameters(self, module: FusedEmbeddingBagCollection) -> Dict[str, nn.Parameter]:  # type: ignore[override]
        """Table name -> its weight (the view into the module's kernel)."""
        return {t.name: _table_weight(module, t.name) for t in module.embedding_bag_configs()}

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [st.value for st in FUSED_EBC_SHARDING_TYPES]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [EmbeddingComputeKernel.FUSED.value]

    def __repr__(self) -> str:
        return "FusedEmbeddingBagCollectionSharder()"


__all__ = ["FusedEmbeddingBagCollectionSharder", "ShardedFusedEmbeddingBagCollection"]
