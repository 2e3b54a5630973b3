"""EmbeddingBagCollectionSharder: shards an EmbeddingBagCollection under a plan (TorchRec's sharder);
EmbeddingCollectionSharder: keeps an EmbeddingCollection's tables as data-parallel replicas.

    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
    sharded = sharder.shard(ebc, plan.plan[""], ShardingEnv.from_process_group(pg), torch.device("cpu"))

The fused optimizer comes from, in order of precedence: torch's
``_apply_optimizer_in_backward(optimizer_class, params, kwargs)`` called on the
unsharded tables, the sharder's ``fused_params``, or the default (row-wise adagrad,
lr 0.01). recship fuses one optimizer per sharded module (one TBE per rank), so
tables of one collection that ask for different optimizers are an error.

recship trains an EmbeddingCollection's tables data-parallel only (TorchRec can also shard
them table-, row- and column-wise): DistributedModelParallel leaves the collection in the
model, where DDP all-reduces its gradients. The planner gives its tables ``data_parallel``;
a plan asking another type for one is an error naming the table.
"""

from typing import Any, Dict, List, Mapping, Optional, Type

import torch

from recship.trainer.distributed.sharded_ebc import ShardedEmbeddingBagCollection
from recship.trainer.distributed.types import ModuleSharder, ShardingEnv
from recship.names import EmbeddingComputeKernel, ShardingType
from recship.trainer.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.fused_optim import FusedOptimizerConfig, fused_config, fused_config_from_torch
from recship.trainer.planner.types import ParameterSharding


class EmbeddingBagCollectionSharder(ModuleSharder[EmbeddingBagCollection]):
    """Shards EmbeddingBagCollections; ``fused_params`` sets their fused optimizer.

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
            raise ValueError(f"EmbeddingBagCollectionSharder(sharded_module_order_overwrite={sharded_module_order_overwrite!r}): "
                             "recship's sharded collection runs its sharding types in one fixed order")
        self.fused_params: Optional[Dict[str, Any]] = dict(fused_params) if fused_params is not None else None
        fused_config(self.fused_params)  # bad keys or values fail here, not at shard time

    @property
    def module_type(self) -> Type[EmbeddingBagCollection]:
        return EmbeddingBagCollection

    def optimizer_config(self, module: Optional[EmbeddingBagCollection] = None) -> FusedOptimizerConfig:
        """The fused optimizer ``module``'s tables get (see the module docstring for precedence)."""
        default = fused_config(self.fused_params)
        if module is None:
            return default
        per_table = {name: _in_backward_config(name, p) for name, p in module.named_parameters()}
        asked = {name: c for name, c in per_table.items() if c is not None}
        if not asked:
            return default
        if len(asked) < len(per_table) or len({repr(c) for c in asked.values()}) > 1:
            settings = {name: (repr(c) if c is not None else "the sharder's fused_params") for name, c in per_table.items()}
            raise ValueError(
                "recship fuses one optimizer per EmbeddingBagCollection, but its tables ask for different ones "
                f"(apply_optimizer_in_backward on some or with different settings): {settings}"
            )
        return next(iter(asked.values()))

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> ShardedEmbeddingBagCollection:
        """The ShardedEmbeddingBagCollection for this rank of ``env`` (which needs a process group)."""
        if not isinstance(module, EmbeddingBagCollection):
            raise TypeError(f"EmbeddingBagCollectionSharder shards EmbeddingBagCollection, got {type(module).__name__}")
        for name, ps in params.items():
            check_training_kernel(name, ps)
        return ShardedEmbeddingBagCollection(module, params, self.optimizer_config(module), pg=env.pg, device=device)

    def __repr__(self) -> str:
        return f"EmbeddingBagCollectionSharder(fused_params={self.fused_params})"


def _in_backward_config(name: str, param: torch.Tensor) -> Optional[FusedOptimizerConfig]:
    """The fused optimizer ``_apply_optimizer_in_backward`` asked for on ``param``, if any."""
    classes = getattr(param, "_optimizer_classes", None)
    if not classes:
        return None
    kwargs = getattr(param, "_optimizer_kwargs", [{}])
    if len(classes) != 1:
        raise ValueError(f"{name}: apply_optimizer_in_backward was called {len(classes)} times; a fused table takes one optimizer")
    return fused_config_from_torch(classes[0], kwargs[0])


class EmbeddingCollectionSharder(ModuleSharder[EmbeddingCollection]):
    """TorchRec's sharder of EmbeddingCollections; in recship their tables stay data-parallel replicas.

    Args:
        fused_params: accepted for TorchRec's signature and checked as the EBC sharder's;
            as in TorchRec, data-parallel tables take no fused optimizer (the dense
            optimizer of ``DistributedModelParallel.dense_parameters()`` updates them).
        qcomm_codecs_registry: TorchRec's quantized-communication codecs: refused.
        use_index_dedup: TorchRec dedups ids before a sharded table's input all-to-all; recship's
            EmbeddingCollection tables are data-parallel (no all-to-all), so either value gives the same.
    """

    def __init__(self, fused_params: Optional[Mapping[str, Any]] = None, qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
                 use_index_dedup: bool = False) -> None:
        _refuse_qcomm(qcomm_codecs_registry)
        self.use_index_dedup = use_index_dedup
        self.fused_params: Optional[Dict[str, Any]] = dict(fused_params) if fused_params is not None else None
        fused_config(self.fused_params)

    @property
    def module_type(self) -> Type[EmbeddingCollection]:
        return EmbeddingCollection

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [ShardingType.DATA_PARALLEL.value]

    def shard(
        self,
        module: EmbeddingCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> EmbeddingCollection:
        """``module`` itself (on ``device`` when given), once every table's plan is data-parallel.

        Raises ValueError naming the table for a table the plan lacks or gives another sharding type.
        """
        if not isinstance(module, EmbeddingCollection):
            raise TypeError(f"EmbeddingCollectionSharder shards EmbeddingCollection, got {type(module).__name__}")
        check_data_parallel(module, params)
        return module if device is None or device.type == "meta" else module.to(device)

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


def check_data_parallel(module: EmbeddingCollection, params: Mapping[str, ParameterSharding]) -> None:
    """ValueError naming the table unless ``params`` gives each of ``module``'s tables ``data_parallel``."""
    names = [t.name for t in module.embedding_configs()]
    missing, unknown = [n for n in names if n not in params], sorted(set(params) - set(names))
    if missing or unknown:
        raise ValueError(f"the plan of an EmbeddingCollection lacks its tables {missing} or names tables it lacks {unknown}")
    for name in names:
        st = params[name].sharding_type
        if st != ShardingType.DATA_PARALLEL:
            raise ValueError(
                f"table {name!r} of an EmbeddingCollection is planned {getattr(st, 'value', st)!r}: recship trains "
                "EmbeddingCollection tables data-parallel only (plan them data_parallel)"
            )
        check_training_kernel(name, params[name])


def get_default_sharders() -> List[ModuleSharder]:
    """The sharders DistributedModelParallel uses when given none, as TorchRec's: EBC's and EC's."""
    return [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]
