"""EmbeddingBagCollectionSharder: shards an EmbeddingBagCollection under a plan (TorchRec's sharder);
EmbeddingCollectionSharder: shards an EmbeddingCollection (table-, row-, column-wise or data-parallel).

    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
    sharded = sharder.shard(ebc, plan.plan[""], ShardingEnv.from_process_group(pg), torch.device("cpu"))

The fused optimizer comes from, in order of precedence: torch's
``_apply_optimizer_in_backward(optimizer_class, params, kwargs)`` called on the
unsharded tables, the sharder's ``fused_params``, or the default (row-wise adagrad,
lr 0.01). recship fuses one optimizer per sharded module (one TBE per rank), so
tables of one collection that ask for different optimizers are an error.

An EmbeddingCollection whose tables are all planned data-parallel stays in the model as it is, where
DistributedModelParallel's DDP all-reduces its gradients; otherwise it becomes a ShardedEmbeddingCollection.
"""

from typing import Any, Dict, List, Mapping, Optional, Type, TypeVar, Union, cast

import torch
from torch import nn

from recship.trainer.distributed.sharded_ebc import ShardedEmbeddingBagCollection
from recship.trainer.distributed.sharded_ec import EC_SHARDING_TYPES, ShardedEmbeddingCollection
from recship.trainer.distributed.sharded_tables import optimizer_for
from recship.trainer.distributed.types import ModuleSharder, ShardingEnv
from recship.names import EmbeddingComputeKernel, ShardingType
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.fused_optim import FusedOptimizerConfig, fused_config
from recship.trainer.planner.types import ParameterSharding

M = TypeVar("M", bound=nn.Module)


class BaseEmbeddingSharder(ModuleSharder[M]):
    """What the embedding sharders share (TorchRec's base): ``fused_params`` sets the fused optimizer.

    Args:
        fused_params: TorchRec's dict: "optimizer" (an EmbOptimType, recship's or
            fbgemm's), "learning_rate", "eps", "weight_decay", "beta1", "beta2".
            Unknown keys are an error.
        qcomm_codecs_registry: TorchRec's quantized-communication codecs; recship's all-to-alls send
            fp32 (and int64 ids): refused.
        sharded_module_order_overwrite: TorchRec's order of sharding types inside the module;
            recship's is fixed: refused.
    """

    def __init__(self, fused_params: Optional[Mapping[str, Any]] = None, qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
                 sharded_module_order_overwrite: Optional[List[Any]] = None) -> None:
        _refuse_qcomm(qcomm_codecs_registry)
        if sharded_module_order_overwrite is not None:
            raise ValueError(f"{type(self).__name__}(sharded_module_order_overwrite={sharded_module_order_overwrite!r}): "
                             "recship's sharded collection runs its sharding types in one fixed order")
        self.fused_params: Optional[Dict[str, Any]] = dict(fused_params) if fused_params is not None else None
        fused_config(self.fused_params)  # bad keys or values fail here, not at shard time

    def optimizer_config(self, module: Optional[nn.Module] = None) -> FusedOptimizerConfig:
        """The fused optimizer ``module``'s tables get (see the module docstring for precedence)."""
        return fused_config(self.fused_params) if module is None else optimizer_for(module, self.fused_params)


class EmbeddingBagCollectionSharder(BaseEmbeddingSharder[EmbeddingBagCollection]):
    """Shards EmbeddingBagCollections; ``fused_params`` sets their fused optimizer (arguments: BaseEmbeddingSharder's)."""

    @property
    def module_type(self) -> Type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> ShardedEmbeddingBagCollection:
        """The ShardedEmbeddingBagCollection for this rank of ``env`` (which needs a process group); ``module_fqn``
        is the module's path in the model (kept for messages)."""
        if not isinstance(module, EmbeddingBagCollection):
            raise TypeError(f"EmbeddingBagCollectionSharder shards EmbeddingBagCollection, got {type(module).__name__}")
        for name, ps in params.items():
            check_training_kernel(name, ps)
        return ShardedEmbeddingBagCollection(module, params, env, self.optimizer_config(module), device, module_fqn=module_fqn)

    def __repr__(self) -> str:
        return f"EmbeddingBagCollectionSharder(fused_params={self.fused_params})"


class EmbeddingCollectionSharder(BaseEmbeddingSharder[EmbeddingCollection]):
    """Shards EmbeddingCollections (sequence embeddings): TorchRec's sharding types for them, table-wise, row-wise,
    column-wise and data-parallel (no table-row-wise, as in TorchRec).

    Args:
        fused_params: the fused optimizer of the sharded tables, as for EmbeddingBagCollectionSharder
            (data-parallel tables take the dense optimizer of ``DistributedModelParallel.dense_parameters()``).
        qcomm_codecs_registry: TorchRec's quantized-communication codecs: refused.
        use_index_dedup: TorchRec sends each distinct id of a batch once; recship sends every id (the rows and
            gradients are the same either way).
    """

    def __init__(self, fused_params: Optional[Mapping[str, Any]] = None, qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
                 use_index_dedup: bool = False) -> None:
        super().__init__(fused_params, qcomm_codecs_registry)
        self.use_index_dedup = use_index_dedup

    @property
    def module_type(self) -> Type[EmbeddingCollection]:  # type: ignore[override]
        return EmbeddingCollection

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [st.value for st in EC_SHARDING_TYPES]

    def shardable_parameters(self, module: EmbeddingCollection) -> Dict[str, nn.Parameter]:
        """Table name -> its weight (TorchRec's)."""
        return {t.name: cast(nn.Parameter, module.embeddings[t.name].weight) for t in module.embedding_configs()}

    def shard(  # type: ignore[override]
        self,
        module: EmbeddingCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> Union[ShardedEmbeddingCollection, EmbeddingCollection]:
        """This rank's ShardedEmbeddingCollection (a collective); ``module`` itself (on ``device``) when every table is
        planned data-parallel: DistributedModelParallel's DDP then trains it whole, as before sharding existed.

        Raises ValueError naming the table for a table the plan lacks, a sharding type TorchRec has no EC sharding
        for (table_row_wise) or a kernel recship cannot train it with.
        """
        if not isinstance(module, EmbeddingCollection):
            raise TypeError(f"EmbeddingCollectionSharder shards EmbeddingCollection, got {type(module).__name__}")
        names = [t.name for t in module.embedding_configs()]
        missing, unknown = [n for n in names if n not in params], sorted(set(params) - set(names))
        if missing or unknown:
            raise ValueError(f"the plan of an EmbeddingCollection lacks its tables {missing} or names tables it lacks {unknown}")
        for name in names:
            check_training_kernel(name, params[name])
        if all(params[n].sharding_type == ShardingType.DATA_PARALLEL for n in names):  # on meta: DMP materialises it
            return module if device is None or device.type == "meta" or module.device.type == "meta" else module.to(device)
        return ShardedEmbeddingCollection(module, params, env, self.optimizer_config(module), device,
                                          use_index_dedup=self.use_index_dedup, module_fqn=module_fqn)

    def __repr__(self) -> str:
        return f"EmbeddingCollectionSharder(fused_params={self.fused_params})"


def _refuse_qcomm(registry: Optional[Dict[str, Any]]) -> None:
    if registry:
        raise ValueError(f"qcomm_codecs_registry={registry!r}: TorchRec's quantized communication (fp16/bf16/fp8 "
                         "all-to-alls); recship's all-to-alls send fp32 outputs and int64 ids only")


def check_training_kernel(name: str, ps: ParameterSharding) -> None:
    """ValueError naming table ``name`` unless its kernel is the one recship trains its sharding type with:
    dense for data_parallel replicas (a torch optimizer updates them), fused (fbgemm TBE, optimizer in backward)
    for every sharded type. TorchRec also runs sharded tables with the dense kernel; recship has no such kernel."""
    want = EmbeddingComputeKernel.DENSE if ps.sharding_type == ShardingType.DATA_PARALLEL else EmbeddingComputeKernel.FUSED
    if ps.compute_kernel != want:
        raise ValueError(
            f"table {name!r} is planned {ps.sharding_type.value!r} with compute kernel {ps.compute_kernel.value!r}: recship "
            f"trains {ps.sharding_type.value} tables with {want.value!r} only (dense: data_parallel replicas; fused: every "
            "sharded type, its optimizer fused into backward)")


def get_default_sharders() -> List[ModuleSharder]:
    """The sharders DistributedModelParallel uses when given none, as TorchRec's: EBC's and EC's."""
    return [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]
