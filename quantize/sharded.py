"""Inference sharding: one process drives N devices, each holding some table shards.

A table is placed whole on one device (table-wise), or split into row blocks
(row-wise) or column blocks (column-wise), each block its own quantized TBE on
its own device. For every device the module builds that device's requests (ids of
row-wise shards bucketed into the block and rebased), runs the device's
QuantEmbeddingBagCollection, moves the result to the first device and merges:
column blocks are concatenated, row-block partial sums added, MEAN divided by the
full bag length last.

Row-wise blocks hold exactly the rows an unsharded table would (quantization is
per row), so table- and row-wise models equal the unsharded quantized model up to
float summation order. Column blocks get their own per-row scale/bias, so a
column-wise model differs from the unsharded one by (at most) quantization error.
"""

import copy
from typing import Any, Dict, List, Optional, Tuple, Union, cast

import torch
from torch import nn

from recship.quantize.feature_processed import FeatureProcessedLookup, QuantFeatureProcessedEmbeddingBagCollection
from recship.quantize.managed_collisions import ManagedCollisionLookup, QuantManagedCollisionEmbeddingBagCollection
from recship.quantize.modules import QuantEmbeddingBagCollection
from recship.quantize.tbe import LookupGroup, LookupLayout, QuantTables, check_ids
from recship.quantize.quantizer import BlockView, HostRows
from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.contract import Shard
from recship.contract.tables import shard_name
from recship.modules.embedding_configs import EmbeddingBagConfig
from recship.modules.embedding_modules import get_embedding_names_by_table
from recship.trainer.planner.planner import bucketize_rows, column_block_count, column_blocks, merge_blocks, row_blocks
from recship.trainer.distributed.types import (FUSED_PARAM_BOUNDS_CHECK_MODE, FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP,
                                               FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS, FUSED_PARAM_REGISTER_TBE_BOOL, ShardingEnv)
from recship.trainer.planner.types import ParameterSharding, ShardingPlan, ShardingType
from recship.modules.types import DataType, PoolingType

torch.fx.wrap(check_ids)  # a single fx node here too (fx.wrap patches per importing module)


class InferenceShard(Shard):
    """A Shard (one block of one table, as the manifest records it) placed by inference sharding."""

    @property
    def name(self) -> str:
        """The block's table (and its features' suffix) inside its device's module."""
        return shard_name(self.table, self.index)


def plan_inference_shards(
    tables: List[EmbeddingBagConfig],
    num_devices: int,
    sharding: Optional[Dict[str, ShardingType]] = None,
    bytes_per_table: Optional[Dict[str, int]] = None,
    device_capacity: Optional[int] = None,
) -> Dict[str, List[InferenceShard]]:
    """Places every table: the given sharding type, or table-wise on the least-loaded device.

    A table-wise table that does not fit ``device_capacity`` bytes is split row-wise
    over all devices; if even that does not fit, ValueError names it.
    """
    sharding = dict(sharding or {})
    sizes = bytes_per_table or {t.name: 0 for t in tables}
    load = [0] * num_devices
    out: Dict[str, List[InferenceShard]] = {}
    for t in sorted(tables, key=lambda t: (-sizes[t.name], t.name)):
        st = sharding.get(t.name, ShardingType.TABLE_WISE)
        size = sizes[t.name]
        if st == ShardingType.TABLE_WISE and device_capacity is not None and size > device_capacity - min(load):
            st = ShardingType.ROW_WISE
        if st == ShardingType.TABLE_WISE:
            d = min(range(num_devices), key=lambda i: (load[i], i))
            shards = [InferenceShard(t.name, 0, d, 0, t.num_embeddings, 0, t.embedding_dim)]
        elif st == ShardingType.ROW_WISE:
            shards = [
                InferenceShard(t.name, i, d, off, n, 0, t.embedding_dim)
                for i, (d, off, n) in enumerate(row_blocks(t.num_embeddings, list(range(num_devices))))
            ]
        elif st == ShardingType.COLUMN_WISE:
            shards = [
                InferenceShard(t.name, i, i, 0, t.num_embeddings, off, w)
                for i, (off, w) in enumerate(column_blocks(t.embedding_dim, column_block_count(t.embedding_dim, num_devices)))
            ]
        else:
            raise ValueError(f"table {t.name!r}: inference sharding must be table_wise, row_wise or column_wise, got {st.value}")
        for s in shards:
            load[s.device] += size * s.rows * s.cols // max(1, t.num_embeddings * t.embedding_dim)
        if device_capacity is not None and max(load) > device_capacity:
            raise ValueError(
                f"table {t.name!r} ({size} bytes quantized) does not fit: {num_devices} device(s) of "
                f"{device_capacity} bytes each"
            )
        out[t.name] = shards
    return {t.name: out[t.name] for t in tables}


class ShardedQuantEmbeddingBagCollection(nn.Module):
    """Quantized tables spread over devices; KJT in (on the first device), KeyedTensor out there.

    TorchRec's constructor shards a QuantEmbeddingBagCollection as a plan says, its stored rows copied:

        sharded = ShardedQuantEmbeddingBagCollection(qebc, {"t0": ps0, "t1": ps1}, ShardingEnv.from_local(2, 0))

    Args:
        module: the QuantEmbeddingBagCollection (its output dtype float32).
        table_name_to_parameter_sharding: table name -> ParameterSharding (table_wise, row_wise or column_wise;
            its ``shards``, or else its ``ranks``, place the blocks), one entry per table.
        env: ``ShardingEnv.from_local(world_size, rank)``: one process drives ``world_size`` devices.
        fused_params: TorchRec's inference keys (``FUSED_PARAM_REGISTER_TBE_BOOL``,
            ``FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS``: the blocks' state_dict layout;
            ``FUSED_PARAM_BOUNDS_CHECK_MODE``, ``FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP``: no effect, ids are always
            checked); any other key is a ValueError.
        device: the device type the blocks go to: cpu (default; ``world_size`` blocks in host memory) or cuda
            (cuda:0 .. cuda:<world_size - 1>).

    ``shard_quantized`` builds one with its rows still to fill (export quantizes float weights into them), and
    ``shard_quant_model`` / the inference sharders build them from quantized modules; see the module docstring.
    """

    _features: List[str]  # the outputs: each feature's name, feature@table for a shared feature
    _requests: List[str]  # the request feature each output reads
    _dims: List[int]
    _unit_feature: List[List[str]]  # per device: the original feature of each unit
    _unit_name: List[List[str]]  # per device: the unit's feature name inside the device module
    _unit_row_offset: List[List[int]]
    _unit_rows: List[List[int]]
    _unit_bucketed: List[List[bool]]
    _unit_col_offset: List[List[int]]
    _unit_cols: List[List[int]]
    _mean: List[bool]
    _rows: List[int]
    _table_of: List[str]
    _modulo: List[bool]

    def __init__(
        self,
        module: QuantEmbeddingBagCollection,
        table_name_to_parameter_sharding: Dict[str, ParameterSharding],
        env: "ShardingEnv",
        fused_params: Optional[Dict[str, Any]] = None,
        device: Optional[torch.device] = None,
    ) -> None:

        super().__init__()
        if not isinstance(module, QuantEmbeddingBagCollection):
            raise TypeError(f"ShardedQuantEmbeddingBagCollection shards a QuantEmbeddingBagCollection, got {type(module).__name__}")
        params = dict(fused_params or {})
        known = (FUSED_PARAM_REGISTER_TBE_BOOL, FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS, FUSED_PARAM_BOUNDS_CHECK_MODE,
                 FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP)
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ValueError(f"ShardedQuantEmbeddingBagCollection: fused_params keys {unknown} are not taken; inference "
                             f"sharding takes {list(known)}")
        devices = local_devices(int(env.world_size), device or "cpu")
        tables = module.embedding_bag_configs()
        shards = _shards_from_plan("", tables, dict(table_name_to_parameter_sharding), len(devices))
        _shard_one(module, devices, {t.name: ShardingType.TABLE_WISE for t in tables}, shards, into=self)
        split, register = bool(params.get(FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS)), bool(params.get(FUSED_PARAM_REGISTER_TBE_BOOL))
        if split or register:
            for block in self.shards:
                cast(QuantEmbeddingBagCollection, block).set_state_dict_layout(split_scale_bias=split, register_tbes=register)

    @classmethod
    def _from_shards(
        cls,
        tables: List[EmbeddingBagConfig],
        shards: Dict[str, List[InferenceShard]],
        device_modules: List[Optional[QuantEmbeddingBagCollection]],
        devices: List[torch.device],
        is_weighted: bool,
        id_policy: Optional[Dict[str, str]] = None,
    ) -> "ShardedQuantEmbeddingBagCollection":
        """One over already-built device modules (what ``shard_quantized`` makes)."""
        sharded = cls.__new__(cls)
        nn.Module.__init__(sharded)
        sharded._build(tables, shards, device_modules, devices, is_weighted, id_policy)
        return sharded

    def _build(
        self,
        tables: List[EmbeddingBagConfig],
        shards: Dict[str, List[InferenceShard]],
        device_modules: List[Optional[QuantEmbeddingBagCollection]],
        devices: List[torch.device],
        is_weighted: bool,
        id_policy: Optional[Dict[str, str]] = None,
    ) -> None:
        self.shards = nn.ModuleList([m for m in device_modules if m is not None])
        self._device_index = [i for i, m in enumerate(device_modules) if m is not None]
        self._device_names = [str(devices[i]) for i in self._device_index]
        self._is_weighted = is_weighted
        output_names = get_embedding_names_by_table(tables)  # a shared feature's outputs: feature@table
        self._features = [name for names in output_names for name in names]
        self._requests = [f for t in tables for f in t.feature_names]
        self._dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        self._mean = [t.pooling == PoolingType.MEAN for t in tables for _ in t.feature_names]
        self._rows = [t.num_embeddings for t in tables for _ in t.feature_names]
        self._table_of = [t.name for t in tables for _ in t.feature_names]
        policy = dict(id_policy or {})
        self._modulo = [policy.get(f, "reject") == "modulo" for f in self._requests]
        self._unit_feature, self._unit_name = [], []
        self._unit_row_offset, self._unit_rows, self._unit_bucketed = [], [], []
        self._unit_col_offset, self._unit_cols = [], []
        for d in self._device_index:
            uf, un, ro, rn, bk, co, cn = [], [], [], [], [], [], []
            for t, names in zip(tables, output_names):
                bucketed = len({(s.row_offset) for s in shards[t.name]}) > 1
                for s in shards[t.name]:
                    if s.device != d:
                        continue
                    for name in names:
                        uf.append(name)
                        un.append(f"{name}@{s.index}")
                        ro.append(s.row_offset)
                        rn.append(s.rows)
                        bk.append(bucketed)
                        co.append(s.col_offset)
                        cn.append(s.cols)
            self._unit_feature.append(uf)
            self._unit_name.append(un)
            self._unit_row_offset.append(ro)
            self._unit_rows.append(rn)
            self._unit_bucketed.append(bk)
            self._unit_col_offset.append(co)
            self._unit_cols.append(cn)

    __jit_unused_properties__ = ["tbes"]

    @property
    def tbes(self) -> List[nn.Module]:
        """The fbgemm inference TBEs of its device modules, device by device (TorchRec's ``tbes``, which model
        post-processing such as ``get_table_to_weights_from_tbe`` walks); their tables are the blocks ``<table>@<k>``."""
        return [tbe for module in self.shards for tbe in cast(List[nn.Module], module.tbes)]

    def lookup_layout(self) -> LookupLayout:
        """Its device modules as the flat lookup runs them: each holds one SUM TBE whose features are its units."""
        groups = []
        for k, module in enumerate(self.shards):
            assert isinstance(module, QuantEmbeddingBagCollection)  # one per device, built by shard_quantized
            (tbe,) = list(module.tbes)
            groups.append(LookupGroup(tbe, list(self._unit_feature[k]), list(self._unit_row_offset[k]), list(self._unit_rows[k]),
                                      list(self._unit_bucketed[k]), list(self._unit_col_offset[k]), list(self._unit_cols[k])))
        return LookupLayout(list(self._features), list(self._dims), list(self._rows), list(self._modulo), list(self._mean),
                            self._is_weighted, groups, torch.device(self._device_names[0]), list(self._requests))

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        given = features.to_dict()
        # ids are checked (or hashed) against whole tables before row blocks split them:
        # an out-of-range id must fail, not fall into no block
        per_feature: Dict[str, JaggedTensor] = {}
        for i, f in enumerate(self._features):
            jt = given[self._requests[i]]
            ids = check_ids(jt.values(), [jt.values().shape[0]], [self._rows[i]], [self._modulo[i]], [self._requests[i]],
                            [self._table_of[i]])
            feature_weights = jt.weights() if self._is_weighted else None
            per_feature[f] = JaggedTensor(values=ids, weights=feature_weights, lengths=jt.lengths(), offsets=jt.offsets())
        first = torch.device(self._device_names[0])
        # per feature: (column offset, output) of each of its units, in device order
        blocks: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
        k = 0
        for module in self.shards:
            device = torch.device(self._device_names[k])
            values: List[torch.Tensor] = []
            lengths: List[torch.Tensor] = []
            weights: List[torch.Tensor] = []
            for u in range(len(self._unit_name[k])):
                jt = per_feature[self._unit_feature[k][u]]
                ids, lens, w = _unit_input(
                    jt, self._unit_row_offset[k][u], self._unit_rows[k][u], self._unit_bucketed[k][u], self._is_weighted
                )
                values.append(ids)
                lengths.append(lens)
                if w is not None:
                    weights.append(w)
            kjt = KeyedJaggedTensor(
                keys=self._unit_name[k],
                values=torch.cat(values).to(device),
                weights=torch.cat(weights).to(device) if self._is_weighted else None,
                lengths=torch.cat(lengths).to(device),
                offsets=None,
                stride=None,
                length_per_key=None,
            )
            out = module(kjt).values().to(first)
            col = 0
            for u in range(len(self._unit_name[k])):
                f = self._unit_feature[k][u]
                if f not in blocks:
                    blocks[f] = torch.jit.annotate(List[Tuple[int, torch.Tensor]], [])
                blocks[f].append((self._unit_col_offset[k][u], out[:, col : col + self._unit_cols[k][u]]))
                col += self._unit_cols[k][u]
            k += 1
        pooled: List[torch.Tensor] = []
        for i, f in enumerate(self._features):
            value = merge_blocks(blocks[f])
            if self._mean[i]:
                value = value / per_feature[f].lengths().to(first).clamp(min=1).unsqueeze(1).to(value.dtype)
            pooled.append(value)
        return KeyedTensor(keys=self._features, length_per_key=self._dims, values=torch.cat(pooled, dim=1), key_dim=1)


def _unit_input(
    jt: JaggedTensor, row_offset: int, rows: int, bucketed: bool, weighted: bool
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(ids, lengths, weights) of one feature for one shard: all ids, or those in the row block, rebased."""
    ids = jt.values()
    lengths = jt.lengths().to(torch.int64)
    weights = jt.weights() if weighted else None
    if not bucketed:
        return ids, lengths, weights
    return bucketize_rows(ids, lengths, weights, row_offset, rows)


def shard_quantized(
    tables: List[EmbeddingBagConfig],
    weight_types: Dict[str, DataType],
    shards: Dict[str, List[InferenceShard]],
    devices: List[torch.device],
    is_weighted: bool,
    id_policy: Optional[Dict[str, str]] = None,
    row_alignment: Optional[int] = None,
    into: Optional[ShardedQuantEmbeddingBagCollection] = None,
    host_rows: Optional[HostRows] = None,
) -> Tuple[ShardedQuantEmbeddingBagCollection, Dict[str, List[BlockView]]]:
    """The sharded module (``into``, when given, a ShardedQuantEmbeddingBagCollection being constructed), its rows
    still empty, and per table the views of its shards to fill.

    Every table's BlockViews tile its [rows, dim] weight, one per shard, in device order
    (``recship.quantize.quantize_into`` fills them from float weights). Ids are validated
    (or hashed, per ``id_policy``) against whole tables before any block sees them. ``host_rows``: where the CPU
    shards' rows are allocated (``recship.quantize.HostRows``).
    """
    modules: List[Optional[QuantEmbeddingBagCollection]] = []
    views: Dict[str, List[BlockView]] = {t.name: [] for t in tables}
    output_names = dict(zip((t.name for t in tables), get_embedding_names_by_table(tables)))  # units' names
    for d, device in enumerate(devices):
        configs, types, placed = [], {}, []
        for t in tables:
            for s in shards[t.name]:
                if s.device != d:
                    continue
                configs.append(
                    EmbeddingBagConfig(
                        name=s.name,
                        num_embeddings=s.rows,
                        embedding_dim=s.cols,
                        feature_names=[f"{name}@{s.index}" for name in output_names[t.name]],
                        pooling=PoolingType.SUM,  # MEAN is applied after merging blocks
                    )
                )
                types[s.name] = weight_types[t.name]
                placed.append(s)
        if not configs:
            modules.append(None)
            continue
        module = QuantEmbeddingBagCollection(configs, is_weighted, device, weight_types=types, row_alignment=row_alignment,
                                             host_rows=host_rows)
        stored = module.table_weights()
        for s in placed:
            rows, cols = slice(s.row_offset, s.row_offset + s.rows), slice(s.col_offset, s.col_offset + s.cols)
            views[s.table].append(BlockView(rows, cols, *stored[s.name]))
        modules.append(module)
    if into is None:
        return ShardedQuantEmbeddingBagCollection._from_shards(tables, shards, modules, devices, is_weighted, id_policy), views
    into._build(tables, shards, modules, devices, is_weighted, id_policy)
    return into, views


def shard_quant_model(
    module: nn.Module,
    devices: Optional[List[Union[str, torch.device]]] = None,
    shards: Optional[int] = None,
    sharding: Union[None, str, ShardingType, Dict[str, Union[str, ShardingType]]] = None,
    inplace: bool = False,
) -> Tuple[nn.Module, Dict[str, Dict[str, List[InferenceShard]]]]:
    """Inference sharding of every QuantEmbeddingBagCollection in ``module``'s tree over several devices.

    Args:
        module: a model after ``quantize_embeddings`` (or a bare QuantEmbeddingBagCollection).
        devices: where the shards go, e.g. ``["cuda:0", "cuda:1"]``; outputs are merged on the first.
        shards: instead of ``devices``: N shards in host memory (``["cpu"] * N``), which
            works on a CPU-only torch build.
        sharding: ``table_wise`` (default: whole tables on the least-loaded device),
            ``row_wise`` or ``column_wise``, for every table or as {table: type}. Column
            blocks are cut from the stored rows, so only FP16 and FP32 tables can be split
            by columns (an integer type's per-row scale covers the whole row; shard such
            tables at export, from the float weights).
        inplace: swap inside ``module``; otherwise a deep copy is sharded.

    The stored rows are copied as they are, so table- and row-wise shards answer what the
    unsharded module answers (up to float summation order). EmbeddingCollections (unpooled
    lookups) are not split: they stay whole on the device they were quantized for. A managed-collision
    collection's remapping stays whole in front of its sharded tables (this process sees every id).

    Returns (the sharded module, {collection path: {table: its shards}}).
    """
    if (devices is None) == (shards is None):
        raise ValueError("give exactly one of devices=[...] and shards=N")
    if devices is not None:
        targets = [torch.device(d) for d in devices]
    else:
        assert shards is not None  # exactly one of the two is given (checked above)
        targets = [torch.device("cpu")] * int(shards)
    if not targets:
        raise ValueError("shard_quant_model needs at least one device")
    if any(d.type == "cuda" for d in targets) and not torch.cuda.is_available():
        raise ValueError(f"devices {[str(d) for d in targets]}: torch sees no CUDA device")
    if not inplace:
        module = copy.deepcopy(module)
    found = [(path, m) for path, m in module.named_modules(remove_duplicate=False) if isinstance(m, QuantEmbeddingBagCollection)]
    if not found:
        raise ValueError(f"{type(module).__name__} holds no QuantEmbeddingBagCollection: quantize it first (quantize_embeddings)")
    all_tables = {t.name for _, m in found for t in m.tables()}
    if isinstance(sharding, dict):
        unknown = sorted(set(sharding) - all_tables)
        if unknown:
            raise ValueError(f"sharding names tables no collection has: {unknown}")
    done: Dict[int, nn.Module] = {}
    plans: Dict[str, Dict[str, List[InferenceShard]]] = {}
    for path, m in found:
        if id(m) not in done:
            tables = m.embedding_bag_configs()
            kinds = {t.name: ShardingType(sharding.get(t.name, "table_wise") if isinstance(sharding, dict) else sharding or "table_wise")
                     for t in tables}
            lookup, plans[path] = _shard_one(m, targets, kinds)
            done[id(m)] = _in_front(m, lookup, targets[0])
        if not path:
            module = done[id(m)]
        else:
            module.set_submodule(path, done[id(m)])
    return module, plans


def _shard_one(
    qebc: QuantEmbeddingBagCollection,
    devices: List[torch.device],
    kinds: Dict[str, ShardingType],
    plan: Optional[Dict[str, List[InferenceShard]]] = None,
    into: Optional[ShardedQuantEmbeddingBagCollection] = None,
) -> Tuple[ShardedQuantEmbeddingBagCollection, Dict[str, List[InferenceShard]]]:
    """(the sharded module (``into`` when given), its shards): ``plan`` places the blocks, or else ``kinds`` and the
    least-loaded device."""
    qebc._require_float32_output("inference sharding")  # the shards answer float32 and merge in float32
    tables = qebc.embedding_bag_configs()
    types = qebc.weight_types()
    for t in tables:
        split_columns = any((s.col_offset, s.cols) != (0, t.embedding_dim) for s in plan[t.name]) if plan else False
        if (split_columns or kinds[t.name] == ShardingType.COLUMN_WISE) and types[t.name] not in (DataType.FP16, DataType.FP32):
            raise ValueError(
                f"table {t.name!r} is {types[t.name].name}: its rows cannot be split by columns after quantization "
                "(one scale per row); shard it table_wise or row_wise, or column_wise at export from the float weights"
            )
    source = qebc.table_weights()
    stored = {name: int(data.numel()) + (0 if sb is None else int(sb.numel())) for name, (data, sb) in source.items()}
    if plan is None:
        plan = plan_inference_shards(tables, len(devices), kinds, bytes_per_table=stored)
    sharded, views = shard_quantized(tables, types, plan, devices, qebc.is_weighted(), qebc.id_policy, into=into)
    for t in tables:
        src_data, src_scale_bias = source[t.name]
        for v in views[t.name]:
            cols = slice(None)
            if (v.cols.start, v.cols.stop) != (0, t.embedding_dim):  # a column block of an FP16/FP32 table: its bytes
                width = torch.empty((), dtype=types[t.name].to_torch_dtype()).element_size()
                cols = slice(v.cols.start * width, v.cols.stop * width)
            v.data.copy_(src_data[v.rows, cols])
            if v.scale_bias is not None:
                assert src_scale_bias is not None  # the block has the source's type, so its scale/bias too
                v.scale_bias.copy_(src_scale_bias[v.rows])
    return sharded, plan


def shard_modules(
    module: nn.Module,
    env: Optional["ShardingEnv"] = None,
    device: Union[None, str, torch.device] = None,
    plan: Optional[ShardingPlan] = None,
    sharders: Optional[list] = None,
) -> nn.Module:
    """TorchRec's ``torchrec.distributed.shard._shard_modules`` for quantized models (inference sharding).

    Replaces every QuantEmbeddingBagCollection in ``module`` (in place) by a
    ShardedQuantEmbeddingBagCollection over ``env.world_size`` local devices and returns
    ``module`` (the sharded collection itself when ``module`` is one). The stored rows are
    copied, so the sharded module answers what the quantized one does.

    Args:
        module: a quantized model (``quantize_dynamic`` / ``quantize_embeddings``).
        env: ``ShardingEnv.from_local(world_size, rank)``; None: the default process
            group's world size (it must be initialised). One process drives all devices,
            so ``rank`` does not change the result.
        device: the device type to shard onto: CPU (``world_size`` shards in host memory)
            or CUDA (``cuda:0`` .. ``cuda:<world_size - 1>``, outputs merged on ``cuda:0``).
            None: CUDA if torch sees one, else CPU.
        plan: a ShardingPlan ({module path: {table: ParameterSharding}}): each table's
            sharding type and ranks (its ``shards`` when given; the compute kernel is
            always the quantized TBE). A collection the plan does not name stays unsharded,
            as in TorchRec. None: table-wise, tables on the least-loaded device.
        sharders: None: every QuantEmbeddingBagCollection (and its FP / managed-collision kinds) is
            sharded, QuantEmbeddingCollections stay whole; or ModuleSharders (``recship.quantize.sharders``'
            QuantEmbeddingBagCollectionSharder, ...): exactly the collections of their ``module_type`` are sharded,
            each by its sharder.
    """
    by_type: Dict[type, Any] = {}
    for sharder in sharders or []:
        if not isinstance(getattr(sharder, "module_type", None), type) or not callable(getattr(sharder, "shard", None)):
            raise TypeError(f"sharders: {sharder!r} is not a ModuleSharder (QuantEmbeddingBagCollectionSharder, ...)")
        by_type[sharder.module_type] = sharder
    if env is None:
        env = ShardingEnv.from_process_group(None)
    world_size = int(env.world_size)
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    devices = local_devices(world_size, device)
    done: Dict[int, Optional[nn.Module]] = {}

    def sharded(path: str, quantized: nn.Module) -> Optional[nn.Module]:
        if id(quantized) not in done:
            table_plan = None if plan is None else plan.get_plan_for_module(path)
            sharder = by_type.get(type(quantized))
            if (plan is not None and table_plan is None) or (sharders is not None and sharder is None):
                done[id(quantized)] = None
            elif sharder is not None:
                done[id(quantized)] = sharder.shard(quantized, table_plan, env, device, module_fqn=path)
            elif isinstance(quantized, QuantEmbeddingBagCollection):
                done[id(quantized)] = shard_collection(path, quantized, table_plan, devices)
            else:
                done[id(quantized)] = None  # a QuantEmbeddingCollection stays whole unless a sharder is given
        return done[id(quantized)]

    def replace(parent: nn.Module, prefix: str) -> None:
        for name, child in parent.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, QuantTables):
                new = sharded(path, child)
                if new is not None:
                    setattr(parent, name, new)
            elif not isinstance(child, (ShardedQuantEmbeddingBagCollection, FeatureProcessedLookup, ManagedCollisionLookup)):  # sharded already
                replace(child, path)

    if isinstance(module, QuantTables):  # TorchRec returns the sharded module itself then
        whole = sharded("", module)
        return module if whole is None else whole
    replace(module, "")
    return module


def local_devices(world_size: int, device: Union[str, torch.device]) -> List[torch.device]:
    """The ``world_size`` devices one process shards onto: the host ``world_size`` times, or cuda:0 .. cuda:N-1."""
    device = torch.device(device)
    if device.type == "cpu":
        return [torch.device("cpu")] * world_size
    if device.type == "cuda":
        if torch.cuda.device_count() < world_size:
            raise ValueError(f"world_size {world_size} on cuda needs {world_size} CUDA devices, torch sees {torch.cuda.device_count()}")
        return [torch.device("cuda", r) for r in range(world_size)]
    raise ValueError(f"device must be cpu or cuda, got {device}")


def shard_collection(path: str, qebc: QuantEmbeddingBagCollection, table_plan: Optional[Dict[str, ParameterSharding]],
                     devices: List[torch.device]) -> nn.Module:
    """``qebc`` (at ``path``) sharded over ``devices``: as ``table_plan`` places its tables, else table-wise on the
    least-loaded device; an FP-EBC keeps its feature processors in front, a managed-collision one its remapping."""
    tables = qebc.embedding_bag_configs()
    kinds = {t.name: ShardingType.TABLE_WISE for t in tables}
    shards = None if table_plan is None else _shards_from_plan(path, tables, table_plan, len(devices))
    return _in_front(qebc, _shard_one(qebc, devices, kinds, shards)[0], devices[0])


def _in_front(qebc: QuantEmbeddingBagCollection, lookup: ShardedQuantEmbeddingBagCollection, first: torch.device) -> nn.Module:
    """``lookup`` (``qebc``'s sharded tables) behind what ``qebc`` runs before its tables: an FP-EBC's feature
    processors, or a managed-collision collection's remapping (whole, on the first device, where the inputs are)."""
    if isinstance(qebc, QuantFeatureProcessedEmbeddingBagCollection):
        return FeatureProcessedLookup(qebc.feature_processor, lookup)
    if isinstance(qebc, QuantManagedCollisionEmbeddingBagCollection):
        return ManagedCollisionLookup(qebc._managed_collision_collection.to(first), lookup, qebc._return_remapped_features)
    return lookup


def _shards_from_plan(
    path: str, tables: List[EmbeddingBagConfig], table_plan: Dict[str, ParameterSharding], world_size: int
) -> Dict[str, List[InferenceShard]]:
    """InferenceShards of a ShardingPlan's entries for one collection; ValueError names what does not fit."""
    where = f"plan for {path or 'the root module'!r}"
    unknown = sorted(set(table_plan) - {t.name for t in tables})
    missing = sorted({t.name for t in tables} - set(table_plan))
    if unknown or missing:
        raise ValueError(f"{where}: names tables the collection lacks {unknown}, or lacks its tables {missing}")
    out: Dict[str, List[InferenceShard]] = {}
    for t in tables:
        ps = table_plan[t.name]
        kind = ShardingType(ps.sharding_type)
        if ps.shards:
            blocks = [(m.rank, m.shard_offsets[0], m.shard_sizes[0], m.shard_offsets[1], m.shard_sizes[1]) for m in ps.shards]
        elif kind == ShardingType.TABLE_WISE and len(ps.ranks) == 1:
            blocks = [(ps.ranks[0], 0, t.num_embeddings, 0, t.embedding_dim)]
        elif kind == ShardingType.ROW_WISE and ps.ranks:
            blocks = [(r, off, n, 0, t.embedding_dim) for r, off, n in row_blocks(t.num_embeddings, list(ps.ranks))]
        elif kind == ShardingType.COLUMN_WISE and ps.ranks:
            blocks = [(r, 0, t.num_embeddings, off, w) for r, (off, w) in zip(ps.ranks, column_blocks(t.embedding_dim, len(ps.ranks)))]
        else:
            raise ValueError(f"{where}: table {t.name!r}: {kind.value} on ranks {ps.ranks} cannot be served by inference sharding")
        inside = all(0 <= r0 and n > 0 and r0 + n <= t.num_embeddings and 0 <= c0 and w > 0 and c0 + w <= t.embedding_dim
                     for _, r0, n, c0, w in blocks)
        if not inside or sum(n * w for _, _, n, _, w in blocks) != t.num_embeddings * t.embedding_dim:
            raise ValueError(f"{where}: the shards of table {t.name!r} do not tile its {t.num_embeddings} x {t.embedding_dim} weight")
        bad = [r for r, *_ in blocks if not 0 <= r < world_size]
        if bad:
            raise ValueError(f"{where}: table {t.name!r} is placed on ranks {bad}, outside world_size {world_size}")
        out[t.name] = [InferenceShard(t.name, i, r, r0, n, c0, w) for i, (r, r0, n, c0, w) in enumerate(blocks)]
    return out
