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

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.trainer.distributed.sharded_module import ShardedEmbeddingModule
from recship.trainer.distributed.sharded_tables import (FUSED_PARAMETER_MARK, LookupUnit, ShardedEmbeddingTables, _lookup_units, optimizer_for,
                                                       _make_tbe, _PooledAllToAll)
from recship.trainer.distributed.types import Awaitable, LazyAwaitable, NoWait, ShardingEnv
from recship.modules.embedding_configs import EmbeddingBagConfig
from recship.modules.embedding_modules import EmbeddingBagCollection, check_features
from recship.trainer.fused_optim import FusedOptimizerConfig
from recship.trainer.planner.planner import bucketize_rows, merge_blocks
from recship.trainer.planner.types import ParameterSharding
from recship.modules.types import PoolingType

# names other modules import from here (they live in sharded_tables, shared with the sharded EmbeddingCollection)
__all__ = ["FUSED_PARAMETER_MARK", "LookupUnit", "ShardedEmbeddingBagCollection", "EmbeddingBagCollectionAwaitable",
           "SparseFeaturesAllToAll", "GroupedPooledEmbeddingsLookup", "PooledEmbeddingsAllToAll", "_lookup_units",
           "_make_tbe", "_PooledAllToAll"]


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


class EmbeddingBagCollectionAwaitable(LazyAwaitable[KeyedTensor]):
    """The output of a sharded EmbeddingBagCollection: a KeyedTensor assembled, when waited for, from the pooled
    embeddings of its groups of features (TorchRec's constructor).

    recship's ShardedEmbeddingBagCollection gives one group, already computed, so ``wait()`` returns at once; the
    result can also be used directly (``out.values()``, ``out["f"]``), as TorchRec's LazyAwaitable allows.

    Args:
        awaitables: per group of features, an Awaitable of their pooled embeddings [B, sum of the group's dims].
        embedding_dims: the dim of every output key, groups in order (the KeyedTensor's ``length_per_key``).
        embedding_names: the output keys, in the same order.
        module_fqn, sharding_types: names for TorchRec's profiler annotations (kept, unused).
        resize_awaitables: awaited after the embeddings (TorchRec frees memory with them).
    """

    def __init__(
        self,
        awaitables: List[Awaitable[torch.Tensor]],
        embedding_dims: List[int],
        embedding_names: List[str],
        module_fqn: Optional[str] = None,
        sharding_types: Optional[List[str]] = None,
        resize_awaitables: Optional[List[Awaitable[torch.Tensor]]] = None,
    ) -> None:
        super().__init__()
        if len(embedding_dims) != len(embedding_names):
            raise ValueError(f"one embedding dim per embedding name: got {len(embedding_dims)} dims for "
                             f"{len(embedding_names)} names {list(embedding_names)}")
        if sharding_types is not None and len(sharding_types) != len(awaitables):
            raise ValueError(f"one sharding type per awaitable: got {len(sharding_types)} for {len(awaitables)} awaitables")
        self._awaitables = list(awaitables)
        self._embedding_dims = list(embedding_dims)
        self._embedding_names = list(embedding_names)
        self._module_fqn = module_fqn
        self._sharding_types = sharding_types
        self._resize_awaitables = resize_awaitables

    def _wait_impl(self) -> KeyedTensor:
        embeddings = [w.wait() for w in self._awaitables]
        for r in self._resize_awaitables or []:
            r.wait()
        if not embeddings:
            raise ValueError("EmbeddingBagCollectionAwaitable has no awaitable to assemble a KeyedTensor from")
        values = embeddings[0] if len(embeddings) == 1 else torch.cat(embeddings, dim=1)
        if values.dim() != 2 or values.shape[1] != sum(self._embedding_dims):
            raise ValueError(f"the pooled embeddings are {list(values.shape)}; the keys {self._embedding_names} need "
                             f"[B, {sum(self._embedding_dims)}]")
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._embedding_dims, values=values, key_dim=1)


class ShardedEmbeddingBagCollection(ShardedEmbeddingModule, ShardedEmbeddingTables):
    """The shard of an EmbeddingBagCollection that this rank owns, plus the collectives.

    Its three stages are the modules ``_input_dists[0]``, ``_lookups[0]`` (holding the
    TBE) and ``_output_dists[0]``; forward returns an EmbeddingBagCollectionAwaitable.

    ``state_dict()`` is TorchRec's: the unsharded collection's keys
    ``embedding_bags.<table>.weight``, a ShardedTensor of this rank's shards (views into
    the TBE) for a sharded table and the replicated tensor for a data-parallel one;
    ``load_state_dict`` takes that, or the unsharded collection's full tensors, and writes
    the shards in place (see ``recship.trainer.distributed.sharded_state``).

    Args (TorchRec's constructor):
        module: the unsharded EmbeddingBagCollection (on "meta" or a real device);
            real weights are copied into this rank's shards, meta ones initialised.
        table_name_to_parameter_sharding: table name -> ParameterSharding, identical on every rank.
        env: the ShardingEnv (its process group; ``ShardingEnv.from_process_group(None)``: the default group).
        fused_params: the fused optimizer of every sharded table: TorchRec's dict (see
            EmbeddingBagCollectionSharder) or a FusedOptimizerConfig; ``apply_optimizer_in_backward`` on the module's
            tables takes precedence over the dict.
        device: where this rank's shards live (default cpu).
        qcomm_codecs_registry: TorchRec's quantized communication: refused (recship sends fp32).
        module_fqn: the module's path in the model (kept for messages).
        sharded_module_order_overwrite: TorchRec's reordering of sharded modules: None only.
    """

    def __init__(
        self,
        module: EmbeddingBagCollection,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: Union[None, Dict[str, Any], FusedOptimizerConfig] = None,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
        module_fqn: Optional[str] = None,
        sharded_module_order_overwrite: Optional[Any] = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        if not isinstance(module, EmbeddingBagCollection):
            raise TypeError(f"ShardedEmbeddingBagCollection shards an EmbeddingBagCollection, got {type(module).__name__}")
        if sharded_module_order_overwrite is not None:
            raise ValueError("sharded_module_order_overwrite: recship runs each sharded module's collectives in its "
                             "forward, in model order; leave it None")
        self._module_fqn = module_fqn
        pg = env.pg
        plan = table_name_to_parameter_sharding
        optimizer = fused_params if isinstance(fused_params, FusedOptimizerConfig) else optimizer_for(module, fused_params)
        self._setup(module.embedding_bag_configs(), plan, optimizer, pg, device)
        self._is_weighted = module.is_weighted()
        args = (self._units_by_rank, self._rank, pg, self._comm_device)
        weighted = self._is_weighted
        mine = self._units_by_rank[self._rank]
        tbes = self._build_tbes(module.embedding_bags, [mine] if mine else [], pooled=True)
        self._input_dists = nn.ModuleList([SparseFeaturesAllToAll(*args, self._device, weighted)])
        self._lookups = nn.ModuleList([GroupedPooledEmbeddingsLookup(tbes[0] if tbes else None, self._device)])
        self._output_dists = nn.ModuleList([PooledEmbeddingsAllToAll(*args, self._device)])
        self._finish(module.embedding_bags)

    @property
    def tbe(self) -> Optional[Any]:
        """This rank's fbgemm SplitTableBatchedEmbeddingBagsCodegen (None on a rank without shards)."""
        return self._lookups[0].tbe

    # -- forward -----------------------------------------------------------

    def forward(self, features: KeyedJaggedTensor) -> EmbeddingBagCollectionAwaitable:
        check_features(features, self._rows)
        per_feature = features.to_dict()
        batch = features.stride()
        received, recv_batches = self._input_dists[0](per_feature, batch)
        local_out = self._lookups[0](received, sum(recv_batches))
        parts = self._output_dists[0](local_out, batch, recv_batches)
        kt = self._assemble(per_feature, parts)
        return EmbeddingBagCollectionAwaitable([NoWait(kt.values())], kt.length_per_key(), kt.keys(), module_fqn=self._module_fqn)


    def _assemble(self, per_feature, parts: List[torch.Tensor]) -> KeyedTensor:
        """Per feature: concatenate column blocks, sum row blocks, divide for MEAN."""
        blocks: Dict[Tuple[str, str], List[Tuple[int, torch.Tensor]]] = {}  # (table, feature) -> column blocks
        for d, units in enumerate(self._units_by_rank):
            col = 0
            for u in units:
                blocks.setdefault((u.table, u.feature), []).append((u.col_offset, parts[d][:, col : col + u.cols]))
                col += u.cols
        pooled, keys, dims = [], [], []
        for t, names in zip(self._configs, self._output_names):
            for f, name in zip(t.feature_names, names):
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
                    out = merge_blocks(blocks[(t.name, f)])
                if t.pooling == PoolingType.MEAN:
                    out = out / jt.lengths().clamp(min=1).unsqueeze(1).to(out.dtype)
                pooled.append(out)
                keys.append(name)
                dims.append(t.embedding_dim)
        return KeyedTensor(keys=keys, length_per_key=dims, values=torch.cat(pooled, dim=1), key_dim=1)

    # -- state -------------------------------------------------------------

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        """The tables, in the unsharded module's order."""
        return list(self._configs)
