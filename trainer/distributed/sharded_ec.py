"""ShardedEmbeddingCollection: an EmbeddingCollection (sequence embeddings) split across ranks by a plan.

TorchRec's sharding types for an EmbeddingCollection: table-wise, row-wise, column-wise and
data-parallel (no table-row-wise: TorchRec's EmbeddingCollectionSharder offers none). The three
stages are the EmbeddingBagCollection's, without pooling:

1. input_dist: ``SparseFeaturesAllToAll`` (shared with the sharded EBC) sends every lookup unit
   (one feature on one shard) the ids it needs; a row-wise shard gets only the ids inside its
   rows, rebased, in the sender's order.
2. lookups: this rank's shards in fbgemm training TBEs without pooling (PoolingMode.NONE: one
   [ids, D] row per id), one TBE per shard width (column-wise blocks of one table may differ in
   width), the optimizer fused into backward.
3. output_dist: one differentiable all-to-all sends each source rank the rows of its own ids;
   the source places row-wise shards' rows back at their ids' positions and concatenates
   column blocks, giving every feature's JaggedTensor of [N, dim] rows in the input's order.

Gradients reaching the shards are divided by the world size on the way back (as for the EBC), so
N ranks with local batch B train like one process with batch N * B and a mean loss.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from recship.sparse import JaggedTensor, KeyedJaggedTensor
from recship.trainer.distributed.sharded_ebc import SparseFeaturesAllToAll
from recship.trainer.distributed.sharded_module import ShardedEmbeddingModule
from recship.trainer.distributed.sharded_tables import LookupUnit, ShardedEmbeddingTables, _PooledAllToAll, optimizer_for
from recship.trainer.distributed.types import Awaitable, LazyAwaitable, NoWait, ShardingEnv
from recship.modules.embedding_configs import EmbeddingConfig
from recship.modules.embedding_modules import EmbeddingCollection, check_features
from recship.trainer.fused_optim import FusedOptimizerConfig
from recship.trainer.planner.types import ParameterSharding, ShardingType

# TorchRec's EmbeddingCollectionSharder.sharding_types()
EC_SHARDING_TYPES = [ShardingType.DATA_PARALLEL, ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.ROW_WISE]


@dataclass
class EmbeddingCollectionContext:
    """TorchRec's context of one sharded EmbeddingCollection call (its fields, for code that builds or reads one).

    recship runs the whole call in ``forward`` and keeps what it needs locally: the lists stay empty
    unless a caller fills them.
    """

    sharding_contexts: List[Any] = field(default_factory=list)
    input_features: List[KeyedJaggedTensor] = field(default_factory=list)
    reverse_indices: List[torch.Tensor] = field(default_factory=list)
    seq_vbe_ctx: List[Any] = field(default_factory=list)
    table_name_to_unpruned_hash_sizes: Dict[str, int] = field(default_factory=dict)
    early_releasable_inputs: List[KeyedJaggedTensor] = field(default_factory=list)

    def record_stream(self, stream: torch.Stream) -> None:
        """Marks the context's CUDA tensors as used on ``stream`` (nothing to do for CPU tensors)."""
        for item in [*self.sharding_contexts, *self.input_features, *self.reverse_indices, *self.seq_vbe_ctx]:
            if isinstance(item, torch.Tensor):
                if item.is_cuda:
                    item.record_stream(stream)  # type: ignore[arg-type]
            elif hasattr(item, "record_stream"):
                item.record_stream(stream)


class EmbeddingCollectionAwaitable(LazyAwaitable[Dict[str, JaggedTensor]]):
    """The output of a sharded EmbeddingCollection: {feature: JaggedTensor of [N, dim] rows} (TorchRec's arguments).

    Args:
        awaitables_per_sharding: per group of features, an Awaitable of their rows [sum of their ids, D],
            features in key order.
        features_per_sharding: per group, the KeyedJaggedTensor of those features (lengths give each one's ids).
        embedding_names_per_sharding: per group, the output name of each feature, in key order.
        ctx: the call's EmbeddingCollectionContext.
        need_indices: each JaggedTensor carries its ids as ``weights``.
        features_to_permute_indices: TorchRec's reorder of column-wise outputs; recship's rows arrive whole: None.
        module_fqn, sharding_types: names for TorchRec's profiler annotations (kept, unused).
        use_gather_select, use_gather_select_per_sharding: TorchRec's choice of split kernel (same results here).
        resize_awaitables: awaited after the rows (TorchRec frees memory with them).
    """

    def __init__(
        self,
        awaitables_per_sharding: List[Awaitable[torch.Tensor]],
        features_per_sharding: List[KeyedJaggedTensor],
        embedding_names_per_sharding: List[List[str]],
        ctx: EmbeddingCollectionContext,
        need_indices: bool = False,
        features_to_permute_indices: Optional[Dict[str, List[int]]] = None,
        module_fqn: Optional[str] = None,
        sharding_types: Optional[List[str]] = None,
        use_gather_select: bool = False,
        use_gather_select_per_sharding: Optional[Dict[str, bool]] = None,
        resize_awaitables: Optional[List[Awaitable[torch.Tensor]]] = None,
    ) -> None:
        super().__init__()
        if features_to_permute_indices:
            raise ValueError("EmbeddingCollectionAwaitable(features_to_permute_indices=...): recship's sharded rows "
                             "arrive with their columns in order; leave it None")
        if not len(awaitables_per_sharding) == len(features_per_sharding) == len(embedding_names_per_sharding):
            raise ValueError(f"one awaitable, KeyedJaggedTensor and name list per sharding: got {len(awaitables_per_sharding)}, "
                             f"{len(features_per_sharding)}, {len(embedding_names_per_sharding)}")
        self._awaitables_per_sharding = awaitables_per_sharding
        self._features_per_sharding = features_per_sharding
        self._embedding_names_per_sharding = embedding_names_per_sharding
        self._ctx = ctx
        self._need_indices = need_indices
        self._module_fqn = module_fqn
        self._sharding_types = sharding_types
        self._resize_awaitables = resize_awaitables or []

    def _wait_impl(self) -> Dict[str, JaggedTensor]:
        out: Dict[str, JaggedTensor] = {}
        for w, features, names in zip(self._awaitables_per_sharding, self._features_per_sharding, self._embedding_names_per_sharding):
            rows = w.wait()
            if len(names) != len(features.keys()):
                raise ValueError(f"{len(names)} embedding names for the {len(features.keys())} features {features.keys()}")
            per_key = features.length_per_key()
            if rows.shape[0] != sum(per_key):
                raise ValueError(f"{rows.shape[0]} rows for the {sum(per_key)} ids of features {features.keys()}")
            values = features.values()
            lengths = features.lengths().view(len(names), -1) if names else features.lengths()
            start = 0
            for i, (name, n) in enumerate(zip(names, per_key)):
                ids = values[start : start + n]
                out[name] = JaggedTensor(values=rows[start : start + n], weights=ids if self._need_indices else None,
                                         lengths=lengths[i])
                start += n
        for r in self._resize_awaitables:
            r.wait()
        return out


class SequenceEmbeddingsLookup(nn.Module):
    """Stage 2, lookups: this rank's units (width groups in order) through one TBE per group, without pooling.

    Returns each unit's rows [its ids over the global batch, cols], in this rank's unit order. The TBEs are held
    outside the module tree, as the sharded EBC's (their weights are the collection's registered views).
    """

    def __init__(self, groups: List[List[LookupUnit]], tbes: List[Any], device: torch.device) -> None:
        super().__init__()
        self._tbes: List[Any]
        object.__setattr__(self, "_tbes", tbes)  # not submodules (see the class docstring)
        self._group_sizes = [len(g) for g in groups]
        self._device = device

    def forward(self, received: KeyedJaggedTensor, global_batch: int) -> List[torch.Tensor]:
        offsets = received.offsets().to(self._device, torch.int64)
        values = received.values().to(self._device)
        per_unit = received.length_per_key()
        out: List[torch.Tensor] = []
        first = 0
        for tbe, n in zip(self._tbes, self._group_sizes):
            lo, hi = first * global_batch, (first + n) * global_batch
            start = offsets[lo]
            rows = tbe(values[int(start) : int(offsets[hi])], offsets[lo : hi + 1] - start)
            out += list(torch.split(rows, per_unit[first : first + n]))
            first += n
        return out


class SequenceEmbeddingsAllToAll(nn.Module):
    """Stage 3, output_dist: sends every source rank the rows of the ids it sent (differentiable).

    Returns, per shard rank d, the rows of this rank's ids for each of d's units ([n, cols] each, d's unit order).
    """

    def __init__(self, units_by_rank: List[List[LookupUnit]], rank: int, pg: Optional[dist.ProcessGroup],
                 comm_device: torch.device, device: torch.device) -> None:
        super().__init__()
        self._units_by_rank = units_by_rank
        self._rank = rank
        self._pg = pg
        self._comm_device = comm_device
        self._device = device

    def forward(self, unit_rows: List[torch.Tensor], received: KeyedJaggedTensor, recv_batches: List[int],
                my_counts: Dict[LookupUnit, int]) -> List[List[torch.Tensor]]:
        mine = self._units_by_rank[self._rank]
        lengths = received.lengths().view(len(mine), -1) if mine else received.lengths()
        # ids each source sent to each of my units: the unit's lengths summed over that source's examples
        per_source = [[int(n) for n in part.sum(dim=1)] for part in torch.split(lengths, recv_batches, dim=1)] if mine else []
        split_rows = [torch.split(rows, [per_source[s][i] for s in range(len(recv_batches))]) for i, rows in enumerate(unit_rows)]
        send_parts: List[torch.Tensor] = []
        send: List[int] = []
        for s in range(len(recv_batches)):
            parts = [split_rows[i][s].reshape(-1) for i in range(len(mine))]
            send_parts += parts
            send.append(sum(p.numel() for p in parts))
        recv_shapes = [[(my_counts[u], u.cols) for u in units] for units in self._units_by_rank]
        recv = [sum(n * c for n, c in shapes) for shapes in recv_shapes]
        flat = torch.cat(send_parts) if send_parts else torch.zeros(0, requires_grad=True)
        scale = 1.0 / len(self._units_by_rank)
        got = _PooledAllToAll.apply(flat.to(self._comm_device), send, recv, self._pg, scale).to(self._device)
        out: List[List[torch.Tensor]] = []
        for part, shapes in zip(torch.split(got, recv), recv_shapes):
            pieces = torch.split(part, [n * c for n, c in shapes])
            out.append([p.view(n, c) for p, (n, c) in zip(pieces, shapes)])
        return out


class ShardedEmbeddingCollection(ShardedEmbeddingModule, ShardedEmbeddingTables):
    """The shards of an EmbeddingCollection this rank owns, plus the collectives (TorchRec's constructor).

    Forward takes the unsharded module's KeyedJaggedTensor (this rank's examples) and returns an
    EmbeddingCollectionAwaitable of {feature: JaggedTensor} equal to the unsharded module's output. Its stages are
    ``_input_dists[0]``, ``_lookups[0]`` and ``_output_dists[0]``.

    ``state_dict()`` is TorchRec's: ``embeddings.<table>.weight``, a ShardedTensor of this rank's shards (views
    into the TBEs) for a sharded table, the replica for a data-parallel one; ``load_state_dict`` takes that or the
    unsharded module's full tensors.

    Args:
        module: the unsharded EmbeddingCollection (on "meta" or a real device).
        table_name_to_parameter_sharding: table name -> ParameterSharding, the same on every rank.
        env: the ShardingEnv (its process group).
        fused_params: the fused optimizer (TorchRec's dict, see EmbeddingBagCollectionSharder, or a
            FusedOptimizerConfig); ``apply_optimizer_in_backward`` on the module's tables takes precedence.
        device: where this rank's shards live (default cpu).
        qcomm_codecs_registry: TorchRec's quantized communication: refused (recship sends fp32).
        use_index_dedup: TorchRec sends each distinct id once; recship sends every id (the same rows and gradients).
        module_fqn: the module's path in the model (kept for messages).
    """

    _TABLES = "embeddings"

    def __init__(
        self,
        module: EmbeddingCollection,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        env: ShardingEnv,
        fused_params: Union[None, Dict[str, Any], FusedOptimizerConfig] = None,
        device: Optional[torch.device] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
        use_index_dedup: bool = False,
        module_fqn: Optional[str] = None,
    ) -> None:
        super().__init__(qcomm_codecs_registry)
        if not isinstance(module, EmbeddingCollection):
            raise TypeError(f"ShardedEmbeddingCollection shards an EmbeddingCollection, got {type(module).__name__}")
        plan = table_name_to_parameter_sharding
        for name, ps in plan.items():
            if ps.sharding_type not in EC_SHARDING_TYPES:
                raise ValueError(f"table {name!r} of an EmbeddingCollection is planned {ps.sharding_type.value!r}: "
                                 f"TorchRec shards EmbeddingCollection tables {[st.value for st in EC_SHARDING_TYPES]} only")
        if env.pg is None and not dist.is_initialized():
            raise ValueError("ShardedEmbeddingCollection trains over a process group: initialise one first")
        self._module_fqn = module_fqn
        self._use_index_dedup = use_index_dedup
        self._need_indices = module.need_indices()
        optimizer = fused_params if isinstance(fused_params, FusedOptimizerConfig) else optimizer_for(module, fused_params)
        self._setup(module.embedding_configs(), plan, optimizer, env.pg, device)
        # Width groups, each unit of one (table, shard) next to the others: fbgemm's CPU kernel without pooling
        # reads wrong rows when a TBE's feature_table_map goes back to an earlier table ([0, 1, 0]).
        self._units_by_rank: List[List[LookupUnit]] = [_grouped(units) for units in self._units_by_rank]
        mine = self._units_by_rank[self._rank]
        groups: List[List[LookupUnit]] = []
        for u in mine:
            if groups and groups[-1][0].cols == u.cols:
                groups[-1].append(u)
            else:
                groups.append([u])
        tbes = self._build_tbes(module.embeddings, groups, pooled=False)
        args = (self._units_by_rank, self._rank, env.pg, self._comm_device)
        self._input_dists = nn.ModuleList([SparseFeaturesAllToAll(*args, self._device, False)])
        self._lookups = nn.ModuleList([SequenceEmbeddingsLookup(groups, tbes, self._device)])
        self._output_dists = nn.ModuleList([SequenceEmbeddingsAllToAll(*args, self._device)])
        self._finish(module.embeddings)

    def forward(self, features: KeyedJaggedTensor) -> EmbeddingCollectionAwaitable:
        check_features(features, self._rows)
        per_feature = features.to_dict()
        batch = features.stride()
        placed = {u: _placement(u, per_feature[u.feature]) for u in self._units}
        my_counts = {u: n for u, (_, n) in placed.items()}
        received, recv_batches = self._input_dists[0](per_feature, batch)
        unit_rows = self._lookups[0](received, sum(recv_batches))
        rows_by_rank = self._output_dists[0](unit_rows, received, recv_batches, my_counts)
        blocks: Dict[Tuple[str, str], List[Tuple[LookupUnit, torch.Tensor]]] = {}
        for units, rows in zip(self._units_by_rank, rows_by_rank):
            for u, r in zip(units, rows):
                blocks.setdefault((u.table, u.feature), []).append((u, r))
        awaitables: List[Awaitable[torch.Tensor]] = []
        kjts: List[KeyedJaggedTensor] = []
        names: List[List[str]] = []
        for t, table_names in zip(self._configs, self._output_names):
            for f, name in zip(t.feature_names, table_names):
                jt = per_feature[f]
                if t.name in self.data_parallel:
                    rows = nn.functional.embedding(jt.values(), self.data_parallel[t.name])
                else:
                    rows = _merge(blocks[(t.name, f)], {u: pos for u, (pos, _) in placed.items()}, jt.values().numel())
                awaitables.append(NoWait(rows.float()))
                kjts.append(KeyedJaggedTensor(keys=[name], values=jt.values(), lengths=jt.lengths(), stride=batch))
                names.append([name])
        return EmbeddingCollectionAwaitable(awaitables, kjts, names, EmbeddingCollectionContext(), self._need_indices,
                                            module_fqn=self._module_fqn, sharding_types=[self._plan[t.name].sharding_type.value
                                                                                         for t in self._configs for _ in t.feature_names])

    # -- TorchRec's accessors ----------------------------------------------

    def embedding_configs(self) -> List[EmbeddingConfig]:
        """The tables, in the unsharded module's order."""
        return list(self._configs)

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_names_by_table(self) -> List[List[str]]:
        """Each table's output names (``feature@table`` for a shared feature), as EmbeddingCollection's."""
        return [list(names) for names in self._output_names]

    def __repr__(self) -> str:
        plan = {t: ps.sharding_type.value for t, ps in self._plan.items()}
        return f"ShardedEmbeddingCollection(rank={self._rank}, world_size={self._world_size}, plan={plan})"


def _grouped(units: List[LookupUnit]) -> List[LookupUnit]:
    """``units`` (one rank's) ordered widest first, each (table, shard)'s units together, else as given."""
    first: Dict[Tuple[str, int], int] = {}
    for i, u in enumerate(units):
        first.setdefault((u.table, u.shard), i)
    return sorted(units, key=lambda u: (-u.cols, first[(u.table, u.shard)]))


def _placement(u: LookupUnit, jt: JaggedTensor) -> Tuple[Optional[torch.Tensor], int]:
    """(positions in the feature's ids of the ids unit ``u`` looks up, or None for all of them; how many)."""
    ids = jt.values()
    if not u.row_bucketed:
        return None, ids.numel()
    inside = ((ids >= u.row_offset) & (ids < u.row_offset + u.rows)).nonzero().view(-1)
    return inside, inside.numel()


def _merge(blocks: List[Tuple[LookupUnit, torch.Tensor]], positions: Dict[LookupUnit, Optional[torch.Tensor]], n: int) -> torch.Tensor:
    """One feature's rows [n, dim] from its units' rows: row blocks put back at their ids' positions, column
    blocks side by side by offset."""
    by_col: Dict[int, List[Tuple[Optional[torch.Tensor], torch.Tensor]]] = {}
    for u, rows in blocks:
        by_col.setdefault(u.col_offset, []).append((positions[u], rows))
    columns = []
    for col in sorted(by_col):
        parts = by_col[col]
        if len(parts) == 1 and parts[0][0] is None:
            columns.append(parts[0][1])
            continue
        where = torch.cat([p for p, _ in parts if p is not None])
        rows = torch.cat([r for _, r in parts])
        columns.append(rows.new_zeros(n, rows.shape[1]).index_copy(0, where, rows))
    return columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)
