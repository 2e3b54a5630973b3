"""ShardedEmbeddingBagCollection: an EmbeddingBagCollection split across ranks by a plan.

Each rank runs three stages, as in TorchRec (the modules ``_input_dists``,
``_lookups`` and ``_output_dists``, one each: recship sends the units of every
sharding type in the same collectives):

1. input_dist: every rank sends each "lookup unit" (one feature on one shard) the
   ids it needs: all ids of the feature for table-wise and column-wise shards;
   for row-wise shards only the ids inside the shard's row block, rebased to it.
   One all-to-all of counts, then one each for lengths, ids and weights. The
   receiver concatenates what it got along the batch (KeyedJaggedTensor.concat_batch),
   so each unit sees the global batch.
2. lookups: one fbgemm SplitTableBatchedEmbeddingBagsCodegen per rank holding all
   of the rank's shards, with the optimizer fused into backward. Lookups always
   pool with SUM; MEAN divides by the full bag length after output_dist, which
   keeps row-wise partial sums exact.
3. output_dist: one differentiable all-to-all sends each source rank its rows of
   every unit's output; the source concatenates column blocks and sums row-wise
   partials, in the unsharded module's key order.

Data-parallel tables are replicated plain tensors looked up locally; their
gradients are averaged across ranks by DistributedDataParallel (see
DistributedModelParallel). Gradients reaching the sharded tables are divided by
the world size in the same way, so N ranks with local batch B train exactly like
one process with batch N * B and a mean loss.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.trainer.distributed import sharded_state
from recship.trainer.distributed.types import NoWait
from recship.trainer.embedding_configs import EmbeddingBagConfig
from recship.trainer.embedding_modules import EmbeddingBagCollection, check_features
from recship.trainer.fused_optim import CombinedOptimizer, EmbeddingFusedOptimizer, EmbOptimType, FusedOptimizerConfig
from recship.trainer.planner.planner import bucketize_rows, merge_blocks
from recship.trainer.planner.types import ParameterSharding, ShardingType
from recship.trainer.types import PoolingType


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


def _lookup_units(
    configs: List[EmbeddingBagConfig], plan: Dict[str, ParameterSharding]
) -> List[LookupUnit]:
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
) -> Any:  # fbgemm's SplitTableBatchedEmbeddingBagsCodegen (untyped)
    """One training TBE over this rank's shards; ``shards`` = [(table, shard, rows, cols)]."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbgemmOptim
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
        WeightDecayMode,
    )

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
        pooling_mode=PoolingMode.SUM,
        bounds_check_mode=BoundsCheckMode.FATAL,
        device=device,
    )


class SparseFeaturesAllToAll(nn.Module):
    """Stage 1, input_dist: sends every lookup unit the ids it needs, from every rank.

    Returns this rank's units over the global batch (one KJT, sources concatenated
    along the batch) and the batch size each source rank sent.
    """

    def __init__(
        self,
        units_by_rank: List[List[LookupUnit]],
        rank: int,
        pg: Optional[dist.ProcessGroup],
        comm_device: torch.device,
        device: torch.device,
        weighted: bool,
    ) -> None:
        super().__init__()
        self._units_by_rank = units_by_rank
        self._rank = rank
        self._pg = pg
        self._comm_device = comm_device
        self._device = device
        self._weighted = weighted

    def forward(self, per_feature: Dict[str, JaggedTensor], batch: int) -> Tuple[KeyedJaggedTensor, List[int]]:
        lengths, ids, weights, counts = [], [], [], []
        for units in self._units_by_rank:
            n_ids = 0
            for u in units:
                l, i, w = _unit_input(u, per_feature[u.feature])
                lengths.append(l)
                ids.append(i)
                if w is not None:
                    weights.append(w)
                n_ids += i.numel()
            counts.append(torch.tensor([n_ids, batch], device=self._comm_device))
        send_counts = torch.stack(counts)  # [world, 2]: ids and batch size for each destination
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self._pg)
        mine = self._units_by_rank[self._rank]
        send_lengths = [len(units) * batch for units in self._units_by_rank]
        recv_batches = [int(b) for b in recv_counts[:, 1]]
        recv_lengths = [len(mine) * b for b in recv_batches]
        recv_ids = [int(n) for n in recv_counts[:, 0]]
        send_ids = send_counts[:, 0].tolist()
        lengths_in = self._exchange(lengths, torch.int64, send_lengths, recv_lengths)
        ids_in = self._exchange(ids, torch.int64, send_ids, recv_ids)
        weights_in = None
        if self._weighted:
            if any(w.requires_grad for w in weights):
                weights_in = self._exchange_differentiable(weights, send_ids, recv_ids)
            else:
                weights_in = self._exchange(weights, torch.float32, send_ids, recv_ids)
        # Source-major blocks -> one KJT per source -> concatenated along the batch.
        keys = [f"u{i}" for i in range(len(mine))]
        l_parts = torch.split(lengths_in, recv_lengths)
        i_parts = torch.split(ids_in, recv_ids)
        w_parts = torch.split(weights_in, recv_ids) if weights_in is not None else None
        per_source = [
            KeyedJaggedTensor(
                keys=keys,
                values=i_parts[s],
                weights=None if w_parts is None else w_parts[s],
                lengths=l_parts[s],
                stride=recv_batches[s],
            )
            for s in range(len(self._units_by_rank))
        ]
        return KeyedJaggedTensor.concat_batch(per_source), recv_batches

    def _exchange(self, parts: List[torch.Tensor], dtype: torch.dtype, send: List[int], recv: List[int]) -> torch.Tensor:
        """All-to-all of the concatenated ``parts`` (send[d] elements to rank d) onto this rank's device."""
        tensor = torch.cat(parts).to(self._comm_device, dtype) if parts else torch.empty(0, dtype=dtype, device=self._comm_device)
        out = tensor.new_empty(sum(recv))
        dist.all_to_all_single(out, tensor, recv, send, group=self._pg)
        return out.to(self._device)


    def _exchange_differentiable(self, parts: List[torch.Tensor], send: List[int], recv: List[int]) -> torch.Tensor:
        """``_exchange`` of weights that require grad (a feature processor's, e.g. position weights): their
        gradients come back to the rank that sent them. Scaled by the world size on the way back, undoing
        the output_dist's 1 / world size: they reach dense parameters, which DDP averages itself."""
        world = len(self._units_by_rank)
        tensor = torch.cat(parts).to(self._comm_device, torch.float32) if parts else torch.zeros(0, device=self._comm_device)
        return _PooledAllToAll.apply(tensor, send, recv, self._pg, float(world)).to(self._device)


def _unit_input(u: LookupUnit, jt: JaggedTensor) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(lengths [B], ids, weights) of feature jt that unit u looks up."""
    ids, lengths, weights = jt.values().to(torch.int64), jt.lengths().to(torch.int64), jt.weights_or_none()
    if not u.row_bucketed:
        return lengths, ids, weights
    ids, lengths, weights = bucketize_rows(ids, lengths, weights, u.row_offset, u.rows)
    return lengths, ids, weights


class GroupedPooledEmbeddingsLookup(nn.Module):
    """Stage 2, lookups: this rank's shards in one fbgemm training TBE (``tbe``, None without shards).

    Returns [global batch, sum of this rank's unit widths] pooled sums. The TBE is held
    outside the module tree (TorchRec's lookups are not submodules either): its weights
    appear in ``state_dict()`` and ``named_parameters()`` of the sharded collection as
    ``embedding_bags.<table>.weight``, views into the TBE, never as its raw buffers.
    """

    def __init__(self, tbe: Optional[nn.Module], device: torch.device) -> None:
        super().__init__()
        object.__setattr__(self, "_tbe", tbe)  # not registered: see the class docstring
        self._device = device

    @property
    def tbe(self) -> Optional[Any]:
        return self._tbe

    def forward(self, received: KeyedJaggedTensor, global_batch: int) -> torch.Tensor:
        if self.tbe is None:
            out = torch.zeros(global_batch, 0, device=self._device, requires_grad=True)
            weights = received.weights_or_none()
            if weights is not None and weights.requires_grad:  # still a path back: every rank runs the weights' all-to-all backward
                out = out + 0.0 * weights.sum()
            return out
        return self.tbe(
            received.values().to(self._device),
            received.offsets().to(self._device, torch.int64),
            per_sample_weights=received.weights_or_none(),
        )


class PooledEmbeddingsAllToAll(nn.Module):
    """Stage 3, output_dist: sends each source rank its rows of every unit's output (differentiable).

    Returns, per rank d, [batch, width of d's units] for this rank's own examples.
    """

    def __init__(
        self, units_by_rank: List[List[LookupUnit]], rank: int, pg: Optional[dist.ProcessGroup], comm_device: torch.device, device: torch.device
    ) -> None:
        super().__init__()
        self._widths = [sum(u.cols for u in units) for units in units_by_rank]
        self._rank = rank
        self._pg = pg
        self._comm_device = comm_device
        self._device = device

    def forward(self, local_out: torch.Tensor, batch: int, recv_batches: List[int]) -> List[torch.Tensor]:
        my_width = self._widths[self._rank]
        send = [b * my_width for b in recv_batches]
        recv = [batch * w for w in self._widths]
        scale = 1.0 / len(self._widths)
        flat = _PooledAllToAll.apply(local_out.to(self._comm_device).reshape(-1), send, recv, self._pg, scale)
        return [part.view(batch, w).to(self._device) for part, w in zip(torch.split(flat, recv), self._widths)]


class EmbeddingBagCollectionAwaitable(NoWait[KeyedTensor]):
    """The output of a sharded EmbeddingBagCollection: its KeyedTensor, already computed.

    recship runs all three stages in forward, so ``wait()`` returns at once; the result
    can also be used directly (``out.values()``), as TorchRec's LazyAwaitable allows.
    """


class ShardedEmbeddingBagCollection(nn.Module):
    """The shard of an EmbeddingBagCollection that this rank owns, plus the collectives.

    Its three stages are the modules ``_input_dists[0]``, ``_lookups[0]`` (holding the
    TBE) and ``_output_dists[0]``; forward returns an EmbeddingBagCollectionAwaitable.

    ``state_dict()`` is TorchRec's: the unsharded collection's keys
    ``embedding_bags.<table>.weight``, a ShardedTensor of this rank's shards (views into
    the TBE) for a sharded table and the replicated tensor for a data-parallel one;
    ``load_state_dict`` takes that, or the unsharded collection's full tensors, and writes
    the shards in place (see ``recship.trainer.distributed.sharded_state``).

    Args:
        module: the unsharded EmbeddingBagCollection (on "meta" or a real device);
            real weights are copied into this rank's shards, meta ones initialised.
        plan: table name -> ParameterSharding, identical on every rank.
        optimizer: the fused optimizer of every sharded table.
        pg: the process group (default: the world).
        device: where this rank's shards live.
    """

    def __init__(
        self,
        module: EmbeddingBagCollection,
        plan: Dict[str, ParameterSharding],
        optimizer: FusedOptimizerConfig,
        pg: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self._pg = pg
        self._rank = dist.get_rank(pg)
        self._world_size = dist.get_world_size(pg)
        self._device = torch.device(device or "cpu")
        # NCCL moves only CUDA tensors; gloo only CPU ones (for all-to-all).
        self._comm_device = self._device if dist.get_backend(pg) == "nccl" else torch.device("cpu")
        optimizer.check_device(self._device.type)
        self._optimizer_config = optimizer
        self._configs = module.embedding_bag_configs()
        self._is_weighted = module.is_weighted()
        missing = [t.name for t in self._configs if t.name not in plan]
        if missing:
            raise ValueError(f"the sharding plan has no entry for tables {missing}")
        self._plan = {t.name: plan[t.name] for t in self._configs}
        self._rows = {f: t.num_embeddings for t in self._configs for f in t.feature_names}
        self._units = _lookup_units(self._configs, self._plan)
        self._units_by_rank = [[u for u in self._units if u.rank == r] for r in range(self._world_size)]
        args = (self._units_by_rank, self._rank, pg, self._comm_device)
        weighted = self._is_weighted
        self._input_dists = nn.ModuleList([SparseFeaturesAllToAll(*args, self._device, weighted)])
        self._lookups = nn.ModuleList([GroupedPooledEmbeddingsLookup(self._build_tbe(module), self._device)])
        self._output_dists = nn.ModuleList([PooledEmbeddingsAllToAll(*args, self._device)])
        self._build_data_parallel(module)
        self._init_torch_state()
        self.fused_optimizer = CombinedOptimizer([("", EmbeddingFusedOptimizer(self, optimizer))])

    @property
    def tbe(self) -> Optional[Any]:
        """This rank's fbgemm SplitTableBatchedEmbeddingBagsCodegen (None on a rank without shards)."""
        return self._lookups[0].tbe

    # -- construction ------------------------------------------------------

    def _build_tbe(self, module: EmbeddingBagCollection) -> Optional[Any]:
        mine = self._units_by_rank[self._rank]
        self._local_shards: List[Tuple[str, int, int, int]] = []
        index: Dict[Tuple[str, int], int] = {}
        unit_shard_index = []
        for u in mine:
            key = (u.table, u.shard)
            if key not in index:
                index[key] = len(self._local_shards)
                self._local_shards.append((u.table, u.shard, u.rows, u.cols))
            unit_shard_index.append(index[key])
        if not self._local_shards:
            return None
        tbe = _make_tbe(self._local_shards, unit_shard_index, self._optimizer_config, self._device)
        for p in tbe.parameters():
            setattr(p, FUSED_PARAMETER_MARK, True)
        configs = {t.name: t for t in self._configs}
        with torch.no_grad():
            for (table, shard, rows, cols), w in zip(self._local_shards, tbe.split_embedding_weights()):
                s = self._plan[table].shards[shard]
                full = module.embedding_bags[table].weight
                assert isinstance(full, torch.Tensor)
                if full.is_meta:
                    lo, hi = configs[table].init_range()
                    w.uniform_(lo, hi)
                else:
                    r0, c0 = s.shard_offsets
                    w.copy_(full[r0 : r0 + rows, c0 : c0 + cols])
        return tbe

    def _build_data_parallel(self, module: EmbeddingBagCollection) -> None:
        self.embedding_bags = nn.ModuleDict({t.name: nn.Module() for t in self._configs})
        for t in self._configs:
            if self._plan[t.name].sharding_type != ShardingType.DATA_PARALLEL:
                continue
            full = module.embedding_bags[t.name].weight
            assert isinstance(full, torch.Tensor)
            w = torch.empty(t.num_embeddings, t.embedding_dim, device=self._device)
            with torch.no_grad():
                if full.is_meta:
                    w.uniform_(*t.init_range())
                else:
                    w.copy_(full)
            self.embedding_bags[t.name].register_parameter("weight", nn.Parameter(w))

    def _init_torch_state(self) -> None:
        """Registers each sharded table's ``embedding_bags.<table>.weight`` (views into the TBE) and builds
        the ShardedTensors that ``state_dict()`` returns for them (TorchRec's ``_initialize_torch_state``)."""
        by_table: Dict[str, sharded_state.LocalShards] = {}
        for (table, shard), w in self.local_shards().items():
            by_table.setdefault(table, []).append((shard, w))
        self._sharded_weights: Dict[str, Any] = {}  # table -> ShardedTensor
        for t in self._configs:
            if t.name in self.data_parallel:
                continue
            local = by_table.get(t.name, [])
            param = sharded_state.local_parameter(local, self._device)
            setattr(param, FUSED_PARAMETER_MARK, True)
            self.embedding_bags[t.name].register_parameter("weight", param)
            self._sharded_weights[t.name] = sharded_state.weight_tensor(
                self._plan[t.name], [t.num_embeddings, t.embedding_dim], local, self._rank, self._device, self._pg
            )
        self._register_state_dict_hook(ShardedEmbeddingBagCollection._post_state_dict_hook)
        self._register_load_state_dict_pre_hook(self._pre_load_state_dict_hook, with_module=True)

    @staticmethod
    def _post_state_dict_hook(module: "ShardedEmbeddingBagCollection", destination: Dict[str, Any], prefix: str, _: Any) -> None:
        for table, st in module._sharded_weights.items():
            destination[f"{prefix}embedding_bags.{table}.weight"] = st

    @staticmethod
    def _pre_load_state_dict_hook(module: "ShardedEmbeddingBagCollection", state_dict: Dict[str, Any], prefix: str, *_: Any) -> None:
        """Writes each sharded table given into the TBE; the registered view then loads itself (a no-op copy)."""
        by_table: Dict[str, sharded_state.LocalShards] = {}
        for (table, shard), w in module.local_shards().items():
            by_table.setdefault(table, []).append((shard, w))
        for t in module._configs:
            key = f"{prefix}embedding_bags.{t.name}.weight"
            if t.name in module.data_parallel or key not in state_dict:
                continue
            sharded_state.copy_into_shards(
                key, state_dict[key], module._plan[t.name], [t.num_embeddings, t.embedding_dim], by_table.get(t.name, [])
            )
            state_dict[key] = module._table_weight(t.name).detach()

    def _table_weight(self, table: str) -> nn.Parameter:
        weight = self.embedding_bags[table].weight
        assert isinstance(weight, nn.Parameter)
        return weight

    @property
    def data_parallel(self) -> Dict[str, nn.Parameter]:
        """Table name -> the replicated weight of each data-parallel table (``embedding_bags.<table>.weight``)."""
        return {
            t.name: self._table_weight(t.name)
            for t in self._configs
            if self._plan[t.name].sharding_type == ShardingType.DATA_PARALLEL
        }

    # -- forward -----------------------------------------------------------

    def forward(self, features: KeyedJaggedTensor) -> EmbeddingBagCollectionAwaitable:
        check_features(features, self._rows)
        per_feature = features.to_dict()
        batch = features.stride()
        received, recv_batches = self._input_dists[0](per_feature, batch)
        local_out = self._lookups[0](received, sum(recv_batches))
        parts = self._output_dists[0](local_out, batch, recv_batches)
        return EmbeddingBagCollectionAwaitable(self._assemble(per_feature, parts))


    def _assemble(self, per_feature, parts: List[torch.Tensor]) -> KeyedTensor:
        """Per feature: concatenate column blocks, sum row blocks, divide for MEAN."""
        blocks: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
        for d, units in enumerate(self._units_by_rank):
            col = 0
            for u in units:
                blocks.setdefault(u.feature, []).append((u.col_offset, parts[d][:, col : col + u.cols]))
                col += u.cols
        pooled, keys, dims = [], [], []
        for t in self._configs:
            for f in t.feature_names:
                jt = per_feature[f]
                if t.name in self.data_parallel:
                    ids = jt.values()
                    out = nn.functional.embedding_bag(
                        ids,
                        self.data_parallel[t.name],
                        jt.offsets().to(ids.dtype),
                        mode="sum",
                        per_sample_weights=jt.weights_or_none() if self._is_weighted else None,  # a KJT may carry
                        include_last_offset=True,  # weights for another (weighted) collection's features
                    )
                else:
                    out = merge_blocks(blocks[f])
                if t.pooling == PoolingType.MEAN:
                    out = out / jt.lengths().clamp(min=1).unsqueeze(1).to(out.dtype)
                pooled.append(out)
                keys.append(f)
                dims.append(t.embedding_dim)
        return KeyedTensor(keys=keys, length_per_key=dims, values=torch.cat(pooled, dim=1), key_dim=1)

    # -- state -------------------------------------------------------------

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        """The tables, in the unsharded module's order."""
        return list(self._configs)

    @property
    def module_sharding_plan(self) -> Dict[str, ParameterSharding]:
        """Table name -> its ParameterSharding (TorchRec's name for it)."""
        return dict(self._plan)

    def local_shards(self) -> Dict[Tuple[str, int], torch.Tensor]:
        """{(table, shard index): weight view} for the shards on this rank."""
        if self.tbe is None:
            return {}
        weights = self.tbe.split_embedding_weights()
        return {(t, s): w for (t, s, _, _), w in zip(self._local_shards, weights)}

    def local_optimizer_states(self) -> Dict[Tuple[str, int], List[torch.Tensor]]:
        """{(table, shard index): [state tensors]} of the fused optimizer on this rank."""
        if self.tbe is None:
            return {}
        states = self.tbe.split_optimizer_states()
        return {(t, s): list(st) for (t, s, _, _), st in zip(self._local_shards, states)}

    def fused_optimizer_state(self) -> Tuple[Dict[str, Any], Dict[Any, Dict[str, Any]]]:
        """TorchRec's fused-optimizer parameters and state of the sharded tables with a shard on this rank.

        Returns ({"embedding_bags.<table>.weight": its ShardedTensor}, {that ShardedTensor:
        {"<table>.momentum1": ShardedTensor, ...}}); the state tensors are the TBE's own (views).
        As in TorchRec, a table without a shard here is not among this rank's parameters.
        """
        layout = sharded_state.OPTIMIZER_STATES[self._optimizer_config.optimizer.name]
        states = self.local_optimizer_states()  # empty for EXACT_SGD (fbgemm keeps no state)
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
            params[f"embedding_bags.{t.name}.weight"] = weight
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
        if self.tbe is not None:
            self.tbe.set_learning_rate(lr)

    @property
    def optimizer(self) -> EmbOptimType:
        return self._optimizer_config.optimizer
