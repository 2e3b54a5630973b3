"""What every sharded embedding collection shares: lookup units, the fused TBEs, the collectives' autograd
function and TorchRec's sharded state.

ShardedEmbeddingBagCollection (pooled, ``sharded_ebc``) and ShardedEmbeddingCollection (sequence,
``sharded_ec``) both derive from ``ShardedEmbeddingTables``, which owns:

- the plan's lookup units (one feature on one shard), in the same order on every rank;
- this rank's fbgemm training TBEs (``SplitTableBatchedEmbeddingBagsCodegen``, optimizer fused into
  backward), built over its shards: one TBE for pooled lookups, one per shard width for sequence
  lookups (a TBE without pooling returns [ids, D] rows of one D);
- the data-parallel tables, plain replicated parameters;
- TorchRec's state: ``<tables>.<table>.weight`` (``embedding_bags`` or ``embeddings``), a ShardedTensor
  of views into the TBEs for a sharded table (``recship.trainer.distributed.sharded_state``), the
  replica for a data-parallel one; the fused optimizer's state under the same names.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbgemmOptim
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen, WeightDecayMode
import torch
import torch.distributed as dist
from torch import nn

from recship.trainer.distributed import sharded_state
from recship.modules.embedding_modules import get_embedding_names_by_table, rows_per_feature
from recship.trainer.fused_optim import (CombinedOptimizer, EmbeddingFusedOptimizer, EmbOptimType, FusedOptimizerConfig, fused_config,
                                        fused_config_from_torch)
from recship.trainer.planner.types import ParameterSharding, ShardingType


# Attribute set on every parameter whose optimizer is fused into backward.
FUSED_PARAMETER_MARK = "_recship_in_backward_optimizer"


@dataclass(frozen=True)
class LookupUnit:
    """One feature looked up in one shard (the unit every stage works in)."""

    feature: str
    table: str
    shard: int  # index into the table's ParameterSharding.shards
    rank: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int
    row_bucketed: bool  # True for row-wise and table-row-wise shards


class _PooledAllToAll(torch.autograd.Function):
    """Differentiable all-to-all of a flat tensor; the backward sends gradients back.

    Gradients are multiplied by ``grad_scale`` on the way back (1 / world size: the
    mean over ranks, matching DistributedDataParallel's averaging of dense grads).
    """

    @staticmethod
    def forward(ctx, x, send: List[int], recv: List[int], pg, grad_scale: float):
        ctx.send, ctx.recv, ctx.pg, ctx.grad_scale = send, recv, pg, grad_scale
        out = x.new_empty(sum(recv))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.pg)
        return back * ctx.grad_scale, None, None, None, None


def _lookup_units(configs: Sequence[Any], plan: Dict[str, ParameterSharding]) -> List[LookupUnit]:
    """All sharded lookup units in a fixed order (every rank computes the same list)."""
    units = []
    for t in configs:
        ps = plan[t.name]
        if ps.sharding_type == ShardingType.DATA_PARALLEL:
            continue
        bucketed = ps.sharding_type in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)
        for f in t.feature_names:
            for i, s in enumerate(ps.shards):
                units.append(
                    LookupUnit(
                        feature=f,
                        table=t.name,
                        shard=i,
                        rank=s.rank,
                        row_offset=s.shard_offsets[0],
                        rows=s.shard_sizes[0],
                        col_offset=s.shard_offsets[1],
                        cols=s.shard_sizes[1],
                        row_bucketed=bucketed,
                    )
                )
    return units


def _make_tbe(
    shards: List[Tuple[str, int, int, int]],
    unit_shard_index: List[int],
    optim: FusedOptimizerConfig,
    device: torch.device,
    pooled: bool = True,
) -> Any:  # fbgemm's SplitTableBatchedEmbeddingBagsCodegen (untyped)
    """One training TBE over ``shards`` = [(table, shard, rows, cols)]; SUM pooling, or none (``pooled=False``:
    [ids, cols] rows, every shard of one width)."""
    if device.type == "cuda":
        location, compute = EmbeddingLocation.DEVICE, ComputeDevice.CUDA
    else:
        location, compute = EmbeddingLocation.HOST, ComputeDevice.CPU
    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(rows, cols, location, compute) for _, _, rows, cols in shards],
        feature_table_map=unit_shard_index,
        optimizer=FbgemmOptim[optim.optimizer.name],
        learning_rate=optim.learning_rate,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        weight_decay_mode=WeightDecayMode.L2 if optim.weight_decay > 0 else WeightDecayMode.NONE,
        beta1=optim.beta1,
        beta2=optim.beta2,
        pooling_mode=PoolingMode.SUM if pooled else PoolingMode.NONE,
        bounds_check_mode=BoundsCheckMode.FATAL,
        device=device,
    )


def optimizer_for(module: nn.Module, fused_params: Optional[Mapping[str, Any]]) -> FusedOptimizerConfig:
    """The fused optimizer of ``module``'s tables: torch's ``_apply_optimizer_in_backward`` called on them, else
    ``fused_params`` (TorchRec's dict), else the default. recship fuses one optimizer per sharded module, so
    tables asking for different ones are a ValueError naming them."""
    default = fused_config(fused_params)
    per_table = {name: _in_backward_config(name, p) for name, p in module.named_parameters()}
    asked = {name: c for name, c in per_table.items() if c is not None}
    if not asked:
        return default
    if len(asked) < len(per_table) or len({repr(c) for c in asked.values()}) > 1:
        settings = {name: (repr(c) if c is not None else "the sharder's fused_params") for name, c in per_table.items()}
        raise ValueError(
            f"recship fuses one optimizer per {type(module).__name__}, but its tables ask for different ones "
            f"(apply_optimizer_in_backward on some or with different settings): {settings}"
        )
    return next(iter(asked.values()))


def _in_backward_config(name: str, param: torch.Tensor) -> Optional[FusedOptimizerConfig]:
    """The fused optimizer ``_apply_optimizer_in_backward`` asked for on ``param``, if any."""
    classes = getattr(param, "_optimizer_classes", None)
    if not classes:
        return None
    kwargs = getattr(param, "_optimizer_kwargs", [{}])
    if len(classes) != 1:
        raise ValueError(f"{name}: apply_optimizer_in_backward was called {len(classes)} times; a fused table takes one optimizer")
    return fused_config_from_torch(classes[0], kwargs[0])


class ShardedEmbeddingTables(nn.Module):
    """The shards, replicas and state of a sharded collection (see the module docstring); subclasses add forward.

    A subclass sets ``_TABLES`` (the unsharded module's ModuleDict name), calls ``_setup``, builds its TBEs with
    ``_build_tbes`` and then calls ``_finish``.
    """

    _TABLES = "embedding_bags"

    def _setup(
        self, configs: Sequence[Any], plan: Dict[str, ParameterSharding], optimizer: FusedOptimizerConfig,
        pg: Optional[dist.ProcessGroup], device: Optional[torch.device],
    ) -> None:
        self._pg = pg
        self._rank = dist.get_rank(pg)
        self._world_size = dist.get_world_size(pg)
        self._device = torch.device(device or "cpu")
        # NCCL moves only CUDA tensors; gloo only CPU ones (for all-to-all).
        self._comm_device = self._device if dist.get_backend(pg) == "nccl" else torch.device("cpu")
        optimizer.check_device(self._device.type)
        self._optimizer_config = optimizer
        self._configs = list(configs)
        missing = [t.name for t in self._configs if t.name not in plan]
        if missing:
            raise ValueError(f"the sharding plan has no entry for tables {missing}")
        self._plan = {t.name: plan[t.name] for t in self._configs}
        self._rows = rows_per_feature(self._configs)
        self._output_names = get_embedding_names_by_table(self._configs)  # per table; feature@table for a shared feature
        self._units = _lookup_units(self._configs, self._plan)
        self._units_by_rank: List[List[LookupUnit]] = [[u for u in self._units if u.rank == r] for r in range(self._world_size)]
        self._local_shards: List[Tuple[str, int, int, int]] = []  # (table, shard, rows, cols), TBE by TBE
        self._tbes: List[Any] = []  # not submodules: their weights are the registered views

    def _build_tbes(self, module_tables: nn.ModuleDict, groups: List[List[LookupUnit]], pooled: bool) -> List[Any]:
        """One TBE per group of this rank's units (each unit a feature of the TBE, in group order); the shards'
        weights are copied from ``module_tables`` (``<table>.weight``) or, on meta, initialised from the configs."""
        configs = {t.name: t for t in self._configs}
        for group in groups:
            index: Dict[Tuple[str, int], int] = {}
            shards: List[Tuple[str, int, int, int]] = []
            unit_shard_index = []
            for u in group:
                key = (u.table, u.shard)
                if key not in index:
                    index[key] = len(shards)
                    shards.append((u.table, u.shard, u.rows, u.cols))
                unit_shard_index.append(index[key])
            tbe = _make_tbe(shards, unit_shard_index, self._optimizer_config, self._device, pooled)
            for p in tbe.parameters():
                setattr(p, FUSED_PARAMETER_MARK, True)
            with torch.no_grad():
                for (table, shard, rows, cols), w in zip(shards, tbe.split_embedding_weights()):
                    full = module_tables[table].weight
                    assert isinstance(full, torch.Tensor)
                    if full.is_meta:
                        w.uniform_(*configs[table].init_range())
                    else:
                        r0, c0 = self._plan[table].shards[shard].shard_offsets
                        w.copy_(full[r0 : r0 + rows, c0 : c0 + cols])
            self._local_shards += shards
            self._tbes.append(tbe)
        return self._tbes

    def _finish(self, module_tables: nn.ModuleDict) -> None:
        """Data-parallel replicas, the registered weights and state hooks, the fused optimizer."""
        self._build_data_parallel(module_tables)
        self._init_torch_state()
        self.fused_optimizer = CombinedOptimizer([("", EmbeddingFusedOptimizer(self, self._optimizer_config))])

    def _build_data_parallel(self, module_tables: nn.ModuleDict) -> None:
        setattr(self, self._TABLES, nn.ModuleDict({t.name: nn.Module() for t in self._configs}))
        for t in self._configs:
            if self._plan[t.name].sharding_type != ShardingType.DATA_PARALLEL:
                continue
            full = module_tables[t.name].weight
            assert isinstance(full, torch.Tensor)
            w = torch.empty(t.num_embeddings, t.embedding_dim, device=self._device)
            with torch.no_grad():
                if full.is_meta:
                    w.uniform_(*t.init_range())
                else:
                    w.copy_(full)
            self._tables()[t.name].register_parameter("weight", nn.Parameter(w))

    def _tables(self) -> nn.ModuleDict:
        tables = getattr(self, self._TABLES)
        assert isinstance(tables, nn.ModuleDict)
        return tables

    def _local_by_table(self) -> Dict[str, sharded_state.LocalShards]:
        by_table: Dict[str, sharded_state.LocalShards] = {}
        for (table, shard), w in self.local_shards().items():
            by_table.setdefault(table, []).append((shard, w))
        return by_table

    def _init_torch_state(self) -> None:
        """Registers each sharded table's ``<tables>.<table>.weight`` (views into the TBEs) and builds the
        ShardedTensors that ``state_dict()`` returns for them (TorchRec's ``_initialize_torch_state``)."""
        by_table = self._local_by_table()
        self._sharded_weights: Dict[str, Any] = {}  # table -> ShardedTensor
        for t in self._configs:
            if t.name in self.data_parallel:
                continue
            local = by_table.get(t.name, [])
            param = sharded_state.local_parameter(local, self._device)
            setattr(param, FUSED_PARAMETER_MARK, True)
            self._tables()[t.name].register_parameter("weight", param)
            self._sharded_weights[t.name] = sharded_state.weight_tensor(
                self._plan[t.name], [t.num_embeddings, t.embedding_dim], local, self._rank, self._device, self._pg
            )
        self._register_state_dict_hook(ShardedEmbeddingTables._post_state_dict_hook)
        self._register_load_state_dict_pre_hook(self._pre_load_state_dict_hook, with_module=True)

    @staticmethod
    def _post_state_dict_hook(module: "ShardedEmbeddingTables", destination: Dict[str, Any], prefix: str, _: Any) -> None:
        for table, st in module._sharded_weights.items():
            destination[f"{prefix}{module._TABLES}.{table}.weight"] = st

    @staticmethod
    def _pre_load_state_dict_hook(module: "ShardedEmbeddingTables", state_dict: Dict[str, Any], prefix: str, *_: Any) -> None:
        """Writes each sharded table given into the TBE; the registered view then loads itself (a no-op copy)."""
        by_table = module._local_by_table()
        for t in module._configs:
            key = f"{prefix}{module._TABLES}.{t.name}.weight"
            if t.name in module.data_parallel or key not in state_dict:
                continue
            sharded_state.copy_into_shards(
                key, state_dict[key], module._plan[t.name], [t.num_embeddings, t.embedding_dim], by_table.get(t.name, [])
            )
            state_dict[key] = module._table_weight(t.name).detach()

    def _table_weight(self, table: str) -> nn.Parameter:
        weight = self._tables()[table].weight
        assert isinstance(weight, nn.Parameter)
        return weight

    @property
    def data_parallel(self) -> Dict[str, nn.Parameter]:
        """Table name -> the replicated weight of each data-parallel table (``<tables>.<table>.weight``)."""
        return {
            t.name: self._table_weight(t.name)
            for t in self._configs
            if self._plan[t.name].sharding_type == ShardingType.DATA_PARALLEL
        }

    # -- state -------------------------------------------------------------

    def state_key(self, table: str) -> str:
        """``<tables>.<table>.weight``: the table's key in this module's state_dict (TorchRec's)."""
        return f"{self._TABLES}.{table}.weight"

    def table_configs(self) -> List[Any]:
        """The tables (EmbeddingBagConfig or EmbeddingConfig), in the unsharded module's order."""
        return list(self._configs)

    @property
    def module_sharding_plan(self) -> Dict[str, ParameterSharding]:
        """Table name -> its ParameterSharding (TorchRec's name for it)."""
        return dict(self._plan)

    def local_shards(self) -> Dict[Tuple[str, int], torch.Tensor]:
        """{(table, shard index): weight view} for the shards on this rank."""
        weights = [w for tbe in self._tbes for w in tbe.split_embedding_weights()]
        return {(t, s): w for (t, s, _, _), w in zip(self._local_shards, weights)}

    def local_optimizer_states(self) -> Dict[Tuple[str, int], List[torch.Tensor]]:
        """{(table, shard index): [state tensors]} of the fused optimizer on this rank."""
        states = [st for tbe in self._tbes for st in tbe.split_optimizer_states()]
        if not states:  # EXACT_SGD: fbgemm keeps no state
            return {}
        return {(t, s): list(st) for (t, s, _, _), st in zip(self._local_shards, states)}

    def fused_optimizer_state(self) -> Tuple[Dict[str, Any], Dict[Any, Dict[str, Any]]]:
        """TorchRec's fused-optimizer parameters and state of the sharded tables with a shard on this rank.

        Returns ({"<tables>.<table>.weight": its ShardedTensor}, {that ShardedTensor:
        {"<table>.momentum1": ShardedTensor, ...}}); the state tensors are the TBE's own (views).
        As in TorchRec, a table without a shard here is not among this rank's parameters.
        """
        layout = sharded_state.OPTIMIZER_STATES[self._optimizer_config.optimizer.name]
        states = self.local_optimizer_states()
        local = list(self.local_shards())
        params: Dict[str, Any] = {}
        state: Dict[Any, Dict[str, Any]] = {}
        for t in self._configs:
            if t.name in self.data_parallel:
                continue
            weight = self._sharded_weights[t.name]
            mine = [(shard, states.get((table, shard), [])) for table, shard in local if table == t.name]
            if not mine:
                continue
            params[f"{self._TABLES}.{t.name}.weight"] = weight
            state[weight] = {
                f"{t.name}.{key}": sharded_state.optimizer_state_tensor(
                    self._plan[t.name], [t.num_embeddings, t.embedding_dim], [(shard, st[i]) for shard, st in mine],
                    pointwise, self._rank, self._device, self._pg,
                )
                for i, (key, pointwise) in enumerate(layout)
            }
        return params, state

    def gather_table(self, table: str) -> Optional[torch.Tensor]:
        """The full [rows, dim] table assembled on rank 0 (None elsewhere); a collective."""
        config = next(t for t in self._configs if t.name == table)
        if table in self.data_parallel:
            return self.data_parallel[table].detach().clone() if self._rank == 0 else None
        full = torch.zeros(config.num_embeddings, config.embedding_dim, device=self._comm_device)
        for (t, s), w in self.local_shards().items():
            if t == table:
                r0, c0 = self._plan[t].shards[s].shard_offsets
                full[r0 : r0 + w.shape[0], c0 : c0 + w.shape[1]] = w.detach()
        dist.reduce(full, dst=dist.get_global_rank(self._pg, 0) if self._pg else 0, group=self._pg)
        full = full.cpu()
        return full if self._rank == 0 else None

    def set_learning_rate(self, lr: float) -> None:
        for tbe in self._tbes:
            tbe.set_learning_rate(lr)

    @property
    def optimizer(self) -> EmbOptimType:
        return self._optimizer_config.optimizer
