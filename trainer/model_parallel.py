"""DistributedModelParallel: shard every EmbeddingBagCollection and EmbeddingCollection of a model, DDP the rest.

    model = DistributedModelParallel(model, device=torch.device("cpu"),
                                     optimizer=FusedOptimizerConfig(EmbOptimType.EXACT_ROWWISE_ADAGRAD, 0.05))
    # or TorchRec's way: sharders=[EmbeddingBagCollectionSharder(fused_params={...})], or
    # torch's _apply_optimizer_in_backward on the unsharded tables
    dense_opt = torch.optim.SGD(model.dense_parameters(), lr=0.05)
    loss = loss_fn(model(dense, kjt)); loss.backward()   # sharded tables update here
    dense_opt.step(); dense_opt.zero_grad()

The fused optimizer updates the sharded tables inside backward; only the dense
parameters (and data-parallel tables) go to a torch optimizer.

As in TorchRec, ``model.module`` is the sharded model itself (no DDP around it) and
``state_dict()`` has the unsharded model's keys (no ``module.`` prefix): each table is
``<path>.embedding_bags.<table>.weight``, a ShardedTensor of this rank's shards, so
``torch.distributed.checkpoint`` saves and reshards it; ``fused_optimizer.state_dict()``
keys the tables' optimizer state by the same names.
"""

import os
from dataclasses import asdict
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from recship.trainer.distributed.sharded_ebc import ShardedEmbeddingBagCollection
from recship.trainer.distributed.sharded_tables import FUSED_PARAMETER_MARK, ShardedEmbeddingTables
from recship.trainer.distributed.sharders import EmbeddingBagCollectionSharder, EmbeddingCollectionSharder, get_default_sharders
from recship.trainer.distributed.fp_sharder import fp_ebc_plan_path
from recship.trainer.distributed.mc_sharder import managed_collision_plan_path, per_rank_buffers, shard_managed_collision_collection
from recship.trainer.planner.planner import with_ebc_sharders
from recship.trainer.distributed.types import ModuleSharder, ShardingEnv
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.fused_embedding_modules import FusedEmbeddingBagCollection
from recship.trainer.fused_optim import CombinedOptimizer, FusedOptimizerConfig
from recship.trainer.planner import EmbeddingShardingPlanner, ShardingPlan, ShardingType, Topology


class DistributedModelParallel(nn.Module):
    """Wraps ``module``: EmbeddingBagCollections sharded per ``plan``, the rest under DDP.

    TorchRec's signature; recship adds ``optimizer`` (shorthand for sharders with
    that ``fused_params``).

    Args:
        module: any model; every EmbeddingBagCollection inside it is sharded.
            Build it on "meta" to allocate only the shards each rank owns.
        env: the ShardingEnv (default: the initialised default process group). Without a process group,
            ``ShardingEnv.from_local(1, 0)`` takes a model with nothing to shard (a quantized one, say), as TorchRec.
        device: this rank's device (default cpu).
        plan: a ShardingPlan; planned with EmbeddingShardingPlanner (on rank 0,
            broadcast) when None.
        sharders: the sharders to use (default ``get_default_sharders()``).
        init_data_parallel: wrap the dense part for data parallelism now (default); False defers it to
            ``init_data_parallel()``, as in TorchRec (e.g. to change the model first).
        init_parameters: allocate and initialise meta-device dense modules (``reset_parameters``) here and
            again before the data-parallel wrap, as TorchRec; False leaves them on meta. Sharded tables are
            always materialised.
        data_parallel_wrapper: wraps the dense part (``DataParallelWrapper.wrap(dmp, env, device)``); default:
            TorchRec's ``DefaultDataParallelWrapper()``: DistributedDataParallel (static_graph=True, as TorchRec)
            over the group when there is more than one rank and a dense parameter, the sharded tables ignored.
        optimizer: settings of the fused embedding optimizer (not with ``sharders``).
    """

    def __init__(
        self,
        module: nn.Module,
        env: Optional[ShardingEnv] = None,
        device: Optional[torch.device] = None,
        plan: Optional[ShardingPlan] = None,
        sharders: Optional[Sequence[ModuleSharder]] = None,
        init_data_parallel: bool = True,
        init_parameters: bool = True,
        data_parallel_wrapper: Optional["DataParallelWrapper"] = None,
        model_tracker_configs: Any = None,
        *,
        optimizer: Optional[FusedOptimizerConfig] = None,
    ) -> None:
        super().__init__()
        if model_tracker_configs is not None:
            raise ValueError("DistributedModelParallel(model_tracker_configs=...): TorchRec's model delta tracker "
                             "(ids touched between checkpoints) is not in recship")
        if env is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("DistributedModelParallel needs torch.distributed.init_process_group first (or env=)")
            env = ShardingEnv.from_process_group(None)
        no_group = env.pg is None and not dist.is_initialized()
        if no_group and env.world_size != 1:
            raise ValueError(f"DistributedModelParallel over {env.world_size} ranks needs a process group: "
                             "ShardingEnv.from_local(world_size > 1) is for inference sharding")
        if no_group and any(type(m) in (EmbeddingBagCollection, EmbeddingCollection) for m in module.modules()):
            raise ValueError("DistributedModelParallel without a process group (ShardingEnv.from_local(1, 0)) takes "
                             "only a model with nothing to shard; to shard embedding tables on one rank, "
                             "init_process_group('gloo', rank=0, world_size=1) first")
        device = torch.device(device or "cpu")
        if optimizer is not None and sharders is not None:
            raise ValueError("give the fused optimizer either as optimizer= or in the sharders' fused_params, not both")
        if sharders is None:
            sharders = ([EmbeddingBagCollectionSharder(asdict(optimizer)), EmbeddingCollectionSharder(asdict(optimizer))] if optimizer
                        else get_default_sharders())
        sharders = with_ebc_sharders(sharders)  # a FeatureProcessedEmbeddingBagCollectionSharder brings its EBC sharder
        sharder = next((s for s in sharders if s.module_type is EmbeddingBagCollection), None)
        if sharder is None and any(isinstance(m, EmbeddingBagCollection) for m in module.modules()):
            raise ValueError(f"none of the sharders {sharders} shards EmbeddingBagCollection")
        if plan is None:
            local = _local_world_size(env.world_size)
            topology = Topology(world_size=env.world_size, compute_device=device.type, local_world_size=local)
            planner = EmbeddingShardingPlanner(topology)
            plan = planner.plan(module, sharders) if no_group else planner.collective_plan(module, sharders, env.pg)
        self.plan = plan
        ec_sharder = next((s for s in sharders if s.module_type is EmbeddingCollection), None)
        fused_sharder = next((s for s in sharders if s.module_type is FusedEmbeddingBagCollection), None)
        sharded: List[Tuple[str, ShardedEmbeddingTables]] = []
        for path, sub in list(module.named_modules()):
            if isinstance(sub, EmbeddingBagCollection):
                tables = plan.get_plan_for_module(path)
                mc_owner = managed_collision_plan_path(module, path)  # a managed-collision collection's tables, as an FP-EBC's:
                owner = fp_ebc_plan_path(module, path) or mc_owner  # its sharded ids are remapped per rank's rows
                if tables is None and owner is not None:  # TorchRec keys an FP-EBC's tables by the FP-EBC's path
                    tables = plan.get_plan_for_module(owner)
                if tables is None:
                    raise ValueError(f"the sharding plan has no entry for module {path or '<root>'!r}")
                assert sharder is not None  # checked above: the model has an EmbeddingBagCollection
                replacement: nn.Module = sharder.shard(sub, tables, env, device)
                assert isinstance(replacement, ShardedEmbeddingBagCollection)
                if mc_owner is not None:
                    shard_managed_collision_collection(module.get_submodule(mc_owner), tables, env, device)
            elif type(sub) is EmbeddingCollection:
                tables = plan.get_plan_for_module(path)
                mc_owner = managed_collision_plan_path(module, path)  # a ManagedCollisionEmbeddingCollection's collection:
                if tables is None and mc_owner is not None:  # its plan may be keyed by the owner's path, as TorchRec's
                    tables = plan.get_plan_for_module(mc_owner)
                if tables is None:  # not planned: it trains under DDP as it is
                    continue
                if ec_sharder is None:  # replicas train under DDP as they are; a sharded table is refused, not ignored
                    shards = sorted(n for n, ps in tables.items() if ps.sharding_type != ShardingType.DATA_PARALLEL)
                    if shards:
                        raise ValueError(f"the plan shards tables {shards} of EmbeddingCollection {path or '<root>'!r}, but "
                                         f"none of the sharders {list(sharders)} shards EmbeddingCollection "
                                         "(add an EmbeddingCollectionSharder)")
                    continue
                replacement = ec_sharder.shard(sub, tables, env, device)
                if replacement is sub or not isinstance(replacement, ShardedEmbeddingTables):  # every table data-parallel
                    continue
                if mc_owner is not None:  # its managed-collision modules remap each rank's ids to that rank's rows
                    shard_managed_collision_collection(module.get_submodule(mc_owner), tables, env, device)
            elif isinstance(sub, FusedEmbeddingBagCollection):  # sharded as an EBC, trained by its own optimizer
                tables = plan.get_plan_for_module(path)
                if fused_sharder is None or tables is None:  # left alone, each rank would train its own copy
                    raise ValueError(f"FusedEmbeddingBagCollection {path or '<root>'!r} needs a FusedEmbeddingBagCollectionSharder "
                                     "among the sharders and an entry in the plan")
                replacement = fused_sharder.shard(sub, tables, env, device, module_fqn=path)
            else:
                continue
            assert isinstance(replacement, ShardedEmbeddingTables)  # each branch's sharded module
            sharded.append((path, replacement))
            if path == "":
                module = replacement
            else:
                module.set_submodule(path, replacement)
        self._sharded = [m for _, m in sharded]
        self.fused_optimizer = CombinedOptimizer([(path, m.fused_optimizer) for path, m in sharded])
        self._env, self._device, self.init_parameters = env, device, init_parameters
        self._data_parallel_wrapper = data_parallel_wrapper or DefaultDataParallelWrapper()
        self._dmp_wrapped_module: nn.Module = module
        self._ddp_wrapped = False
        if init_parameters:  # as TorchRec: now, whether or not the data-parallel wrap waits
            _materialize_dense(module, device, self._sharded)
        if init_data_parallel:
            self.init_data_parallel()

    def init_data_parallel(self) -> None:
        """Wraps the dense part for data parallelism (once; later calls do nothing), after allocating meta-device
        dense modules when ``init_parameters``: what the constructor does unless ``init_data_parallel=False``."""
        if self._ddp_wrapped:
            return
        if self.init_parameters:
            _materialize_dense(self._dmp_wrapped_module, self._device, self._sharded)
        self._data_parallel_wrapper.wrap(self, self._env, self._device)
        self._ddp_wrapped = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._dmp_wrapped_module(*args, **kwargs)

    @property
    def module(self) -> nn.Module:
        """The sharded model, without the DistributedDataParallel wrapper (TorchRec's ``DMP.module``)."""
        m = self._dmp_wrapped_module
        return m.module if isinstance(m, DistributedDataParallel) else m

    @property
    def unwrapped(self) -> nn.Module:
        """The same as ``module``."""
        return self.module

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The model's state_dict under the unsharded model's keys (tables as ShardedTensors, see the module docstring)."""
        if args:
            raise TypeError("DistributedModelParallel.state_dict takes keyword arguments only (destination=, prefix=, keep_vars=)")
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Loads a ``state_dict()`` of this model, sharded or not (an unsharded model's full tables work too)."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the sharded tables' views; load by copy")
        return self.module.load_state_dict(state_dict, strict=strict)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """The model's parameters by their unsharded names (``sparse.embedding_bags.t.weight``, ``over.0.weight``)."""
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters for a torch optimizer: everything but the fused tables."""
        return self._dense_params(self.module)

    @staticmethod
    def _dense_params(module: nn.Module) -> Iterator[nn.Parameter]:
        for _, p in in_backward_optimizer_filter(module.named_parameters()):
            yield p

    def sharded_modules(self) -> List[ShardedEmbeddingTables]:
        """The sharded collections (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection), in model order."""
        return list(self._sharded)


class DataParallelWrapper:
    """TorchRec's interface: ``wrap(dmp, env, device)`` replaces ``dmp._dmp_wrapped_module`` with the dense part's
    data-parallel wrapper (called once, by ``DistributedModelParallel.init_data_parallel``)."""

    def wrap(self, dmp: "DistributedModelParallel", env: ShardingEnv, device: torch.device) -> None:
        raise NotImplementedError


def _ddp(dmp: "DistributedModelParallel", env: ShardingEnv, device: torch.device, ignore: Sequence[str] = (),
         **ddp_kwargs: Any) -> Optional[DistributedDataParallel]:
    """DDP around ``dmp``'s model, or None (nothing to wrap: one rank, or no dense parameter).

    DDP must neither all-reduce nor broadcast from rank 0 what differs per rank: the fused tables and the
    TBE's per-rank metadata buffers."""
    module = dmp._dmp_wrapped_module
    if isinstance(module, DistributedDataParallel) or env.world_size <= 1:
        return None
    if all(getattr(p, FUSED_PARAMETER_MARK, False) for p in module.parameters()):
        return None
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, _per_rank_state(module) + list(ignore))
    device_ids = None if device.type == "cpu" else [device]
    wrapped = DistributedDataParallel(module, process_group=env.pg, device_ids=device_ids, **ddp_kwargs)
    dmp._dmp_wrapped_module = wrapped
    return wrapped


class DefaultDataParallelWrapper(DataParallelWrapper):
    """TorchRec's DDP settings for the dense part.

    Args:
        bucket_cap_mb, static_graph, find_unused_parameters: DistributedDataParallel's.
        allreduce_comm_precision: "fp16" or "bf16" compresses the gradients' all-reduce (torch's
            ``fp16_compress_hook`` / ``bf16_compress_hook``); None keeps fp32.
        params_to_ignore: more parameter names DDP leaves alone (the sharded tables always are).
        ddp_kwargs: further DistributedDataParallel arguments.
    """

    def __init__(self, bucket_cap_mb: int = 25, static_graph: bool = True, find_unused_parameters: bool = False,
                 allreduce_comm_precision: Optional[str] = None, params_to_ignore: Optional[List[str]] = None,
                 ddp_kwargs: Optional[Dict[str, Any]] = None) -> None:
        if allreduce_comm_precision not in (None, "fp16", "bf16"):
            raise ValueError(f"allreduce_comm_precision must be 'fp16', 'bf16' or None, got {allreduce_comm_precision!r}")
        self._kwargs = dict(ddp_kwargs or {}, bucket_cap_mb=bucket_cap_mb, static_graph=static_graph,
                            find_unused_parameters=find_unused_parameters)
        self._precision = allreduce_comm_precision
        self._ignore = list(params_to_ignore or [])

    def wrap(self, dmp: "DistributedModelParallel", env: ShardingEnv, device: torch.device) -> None:
        wrapped = _ddp(dmp, env, device, self._ignore, **self._kwargs)
        if wrapped is not None and self._precision is not None:
            hook = default_hooks.fp16_compress_hook if self._precision == "fp16" else default_hooks.bf16_compress_hook
            wrapped.register_comm_hook(env.pg, hook)


def shard_modules(
    module: nn.Module,
    env: Optional[ShardingEnv] = None,
    device: Optional[torch.device] = None,
    plan: Optional[ShardingPlan] = None,
    sharders: Optional[Sequence[ModuleSharder]] = None,
    init_params: bool = False,
) -> nn.Module:
    """TorchRec's ``torchrec.distributed.shard.shard_modules`` for training: ``module`` with its embedding collections
    sharded in place (as DistributedModelParallel shards them, planned the same way when ``plan`` is None) and no
    data-parallel wrapper. ``init_params``: allocate and initialise meta-device dense modules (TorchRec's default
    leaves them). ``recship.distributed.shard_modules`` sends a quantized model to inference sharding instead.
    """
    dmp = DistributedModelParallel(module, env, device, plan, sharders, init_data_parallel=False, init_parameters=init_params)
    if init_params:
        _materialize_dense(dmp.module, dmp._device, dmp._sharded)
    return dmp.module


def in_backward_optimizer_filter(
    named_parameters: Iterator[Tuple[str, nn.Parameter]], include: bool = False
) -> Iterator[Tuple[str, nn.Parameter]]:
    """Filters ``model.named_parameters()`` for a torch optimizer.

    With include=False (the default) it yields the parameters a torch optimizer
    should update (dense layers, data-parallel tables) and drops those updated in
    backward: the sharded tables (their optimizer fused into the TBE) and any parameter
    torch's ``_apply_optimizer_in_backward`` gave an optimizer (it carries
    ``_in_backward_optimizers``, the attribute TorchRec's filter reads); include=True
    yields only those.
    """
    for name, p in named_parameters:
        in_backward = getattr(p, FUSED_PARAMETER_MARK, False) or hasattr(p, "_in_backward_optimizers")
        if in_backward == include:
            yield name, p


def _per_rank_state(module: nn.Module) -> List[str]:
    """Names of the sharded tables' parameters (views of this rank's shards: different on every rank)."""
    names = []
    for path, sub in module.named_modules():
        if isinstance(sub, ShardedEmbeddingTables):
            prefix = f"{path}." if path else ""
            names += [prefix + n for n, p in sub.named_parameters() if getattr(p, FUSED_PARAMETER_MARK, False)]
    return names + per_rank_buffers(module)


def _materialize_dense(module: nn.Module, device: torch.device, sharded: Sequence[nn.Module]) -> None:
    """Allocates and initialises meta-device dense submodules (sharded ones are already real)."""
    skip = {id(m) for s in sharded for m in s.modules()}
    for sub in module.modules():
        if id(sub) in skip:
            continue
        own = list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False))
        if any(t.is_meta for t in own):
            sub.to_empty(device=device, recurse=False)
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()


def init_parameters(module: nn.Module, device: torch.device) -> None:
    """TorchRec's ``torchrec.distributed.utils.init_parameters``: when a parameter of ``module`` is not on ``device``,
    moves the whole module there (allocating it, uninitialised, if a parameter is on meta) and then calls
    ``reset_parameters()`` on every submodule that has one, so all of it is freshly initialised. A module whose
    parameters are all on ``device`` already is left as it is."""
    device = torch.device(device)
    params = list(module.parameters())
    if all(p.device == device for p in params):
        return
    with torch.no_grad():
        if any(p.is_meta for p in params):
            module.to_empty(device=device)
        else:
            module.to(device)
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()


def _local_world_size(world_size: int) -> int:
    value = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return value if world_size % value == 0 else world_size
