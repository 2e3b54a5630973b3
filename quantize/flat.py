"""The flat inference forward: request tensors in, fbgemm's lookup op called directly.

The quantized collections (``QuantEmbeddingBagCollection``, its inference-sharded
``ShardedQuantEmbeddingBagCollection``, ``QuantEmbeddingCollection``) build KeyedJagged-
Tensors, split features and call fbgemm's TBE modules, whose forwards carry TorchBind
state; at small batches that bookkeeping costs several times the lookup itself, and
torch.export cannot take it. The modules here are what an exported model runs instead:

- ``FlatTBE``: one inference TBE as plain buffers (rows, offsets, types) and one call of
  ``torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function``;
- ``FlatPooledLookup``: forward(lengths [F*B], values [N], weights [N] or None) ->
  [B, sum of dims], features in request order, for any inference sharding (table-,
  row-, column-wise over N shards), SUM and MEAN, weighted or not, id policies;
- ``FlatEmbeddingBagCollection`` / ``FlatEmbeddingCollection``: the same behind the
  collections' KJT contract, for models whose own forward hands a KJT to them.

Every shape is static in the request's sizes (B and N) except where a shard sees a
subset of the features, so the same module runs under TorchScript and torch.export /
AOTInductor. Row-wise blocks see all of their feature's ids, those outside the block
weighted 0 (rebased ids clamped to row 0): exactly the block's partial sum, with no
data-dependent sizes.

Ids: an id outside its table is an error, or hashed into it for "modulo" features.
Under TorchScript (and eager) the error is the id rule's ValueError (``feature 'f': id 7
is out of range [0, 5)``); while torch.export traces it (``IdCheck.asserts``) it checks
with a tensor assert instead (the server and the C++ loader validate requests before the
model; the assert is the backstop). The rows are the quantized module's storage, shared,
not copied.
"""

import copy
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from recship.quantize.feature_processed import FeatureProcessedLookup, QuantFeatureProcessedEmbeddingBagCollection
from recship.quantize.modules import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from recship.quantize.sharded import ShardedQuantEmbeddingBagCollection
from recship.quantize.tbe import LookupLayout
from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.sparse.ids import check_id_dtype, first_out_of_range, out_of_range_message


class FlatTBE(nn.Module):
    """One fbgemm inference TBE: its storage as buffers and a direct call of the lookup op.

    Args:
        tbe: an initialised ``IntNBitTableBatchedEmbeddingBagsCodegen`` whose rows are filled;
            its tensors are shared, not copied.
    """

    weights: torch.Tensor
    weights_uvm: torch.Tensor
    weights_placements: torch.Tensor
    weights_offsets: torch.Tensor
    weights_tys: torch.Tensor
    D_offsets: torch.Tensor
    lxu_cache_weights: torch.Tensor
    lxu_cache_locations: torch.Tensor

    def __init__(self, tbe: nn.Module) -> None:
        super().__init__()
        host = int(getattr(tbe, "host_size")) > 0
        self.register_buffer("weights", getattr(tbe, "weights_host") if host else getattr(tbe, "weights_dev"))
        for name in ("weights_uvm", "weights_placements", "weights_offsets", "weights_tys", "D_offsets", "lxu_cache_weights"):
            self.register_buffer(name, getattr(tbe, name))
        device = self.weights.device
        self.register_buffer("lxu_cache_locations", torch.empty(0, dtype=torch.int32, device=device))
        self.total_D = int(getattr(tbe, "total_D"))
        self.max_int2_D = int(getattr(tbe, "max_int2_D"))
        self.max_int4_D = int(getattr(tbe, "max_int4_D"))
        self.max_int8_D = int(getattr(tbe, "max_int8_D"))
        self.max_float16_D = int(getattr(tbe, "max_float16_D"))
        self.max_float32_D = int(getattr(tbe, "max_float32_D"))
        self.max_float8_D = int(getattr(tbe, "max_float8_D"))
        self.pooling_mode = int(getattr(tbe, "pooling_mode"))
        self.output_dtype = int(getattr(tbe, "output_dtype"))
        self.row_alignment = int(getattr(tbe, "row_alignment"))
        self.fp8_exponent_bits = int(getattr(tbe, "fp8_exponent_bits"))
        self.fp8_exponent_bias = int(getattr(tbe, "fp8_exponent_bias"))
        self.device_name = str(device)
        # which table each row block of ``weights`` (or ``weights_uvm``) is: the artifact's tables file names them
        specs = getattr(tbe, "embedding_specs")
        self.table_names: List[str] = [str(s[0]) for s in specs]
        self.table_rows: List[int] = [int(s[1]) for s in specs]
        # weights_offsets and weights_placements have one entry per feature: a table's is its first feature's
        feature_table_map = [int(t) for t in getattr(tbe, "feature_table_map")]
        self.table_first_feature: List[int] = [feature_table_map.index(t) for t in range(len(specs))]

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
        """indices [N] int64, offsets [T*B + 1] int64 (T: the TBE's features), weights [N] float32 or None
        -> [B, total_D] float32 (pooled) or [N, D] (unpooled)."""
        if self.weights.numel() == 0 and self.weights_uvm.numel() == 0:  # a model.pt loaded without its tables.bin
            raise RuntimeError("this TBE has no rows: an artifact's model.pt takes its tables from tables.bin at load "
                               "(recship.export.artifact.open_artifact, or the README's 'Loading an artifact without recship')")
        return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            dev_weights=self.weights,
            uvm_weights=self.weights_uvm,
            weights_placements=self.weights_placements,
            weights_offsets=self.weights_offsets,
            weights_tys=self.weights_tys,
            D_offsets=self.D_offsets,
            total_D=self.total_D,
            max_int2_D=self.max_int2_D,
            max_int4_D=self.max_int4_D,
            max_int8_D=self.max_int8_D,
            max_float16_D=self.max_float16_D,
            max_float32_D=self.max_float32_D,
            indices=indices,
            offsets=offsets,
            pooling_mode=self.pooling_mode,
            indice_weights=weights,
            output_dtype=self.output_dtype,
            lxu_cache_weights=self.lxu_cache_weights,
            lxu_cache_locations=self.lxu_cache_locations,
            row_alignment=self.row_alignment,
            max_float8_D=self.max_float8_D,
            fp8_exponent_bits=self.fp8_exponent_bits,
            fp8_exponent_bias=self.fp8_exponent_bias,
        )


class IdCheck(nn.Module):
    """The id rule on request tensors: forward(values [N] int64, lengths [F*B] int64, B) -> values,
    those of "modulo" features hashed into their tables; an id outside its table raises
    the id rule's ValueError, or (``asserts``, set while torch.export traces) fails a tensor assert."""

    feature_names: List[str]
    table_rows: List[int]
    rows_per_feature: torch.Tensor
    modulo_per_feature: torch.Tensor

    def __init__(self, feature_names: List[str], table_rows: List[int], modulo: List[bool],
                 device: torch.device = torch.device("cpu")) -> None:
        super().__init__()
        self.feature_names = list(feature_names)
        self.table_rows = list(table_rows)
        self.num_features = len(feature_names)
        self.any_modulo = any(modulo)
        self.min_rows = min(table_rows)
        self.asserts = False
        self.register_buffer("rows_per_feature", torch.tensor(table_rows, dtype=torch.int64, device=device))
        self.register_buffer("modulo_per_feature", torch.tensor(modulo, dtype=torch.bool, device=device))

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, batch: int) -> torch.Tensor:
        check_id_dtype(values, "quantized embedding lookup")
        n = values.shape[0]
        if not self.asserts and not self.any_modulo:
            if n == 0:
                return values
            lo, hi = torch.aminmax(values)
            if int(lo) >= 0 and int(hi) < self.min_rows:  # the usual case: one pass
                return values
        limit = self.rows_per_feature.repeat_interleave(batch).repeat_interleave(lengths, output_size=n)
        if self.any_modulo:
            hashed = self.modulo_per_feature.repeat_interleave(batch).repeat_interleave(lengths, output_size=n)
            values = torch.where(hashed, torch.remainder(values, limit), values)
        bad = (values < 0) | (values >= limit)
        if self.asserts:
            torch._assert_async(torch.logical_not(bad.any()), "recship: a request id is out of range of its table")
        elif bool(bad.any()):
            raise ValueError(self._out_of_range(values, lengths, batch))
        return values

    def _out_of_range(self, values: torch.Tensor, lengths: torch.Tensor, batch: int) -> str:
        counts: List[int] = lengths.view(self.num_features, batch).sum(1).tolist()
        start = 0
        for f in range(self.num_features):
            bad = first_out_of_range(values[start : start + counts[f]], self.table_rows[f])
            if bad is not None:
                return out_of_range_message(self.feature_names[f], bad, self.table_rows[f])
            start += counts[f]
        return "an id is out of range of its table"


class _Shard(nn.Module):
    """A FlatTBE and where its inputs come from: unit u (one of its features) reads request
    feature ``features[u]``, rows [row_offset[u], row_offset[u] + rows[u]) of that feature's
    table when ``bucketed``; its output columns land at ``columns`` of the result."""

    features: torch.Tensor
    row_offsets: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor

    def __init__(
        self,
        tbe: nn.Module,
        features: List[int],
        row_offsets: List[int],
        rows: List[int],
        columns: List[int],
        bucketed: bool,
        num_features: int,
        result_device: torch.device,
    ) -> None:
        super().__init__()
        self.tbe = FlatTBE(tbe)
        self.device_name = self.tbe.device_name
        self.all_in_order = features == list(range(num_features))
        self.same_size = sorted(features) == list(range(num_features))  # every feature once: N ids in, as many out
        self.bucketed = bucketed
        # the request's tensors are on the result device (the first shard's): the routing lives there too
        self.register_buffer("features", torch.tensor(features, dtype=torch.int64, device=result_device))
        self.register_buffer("row_offsets", torch.tensor(row_offsets, dtype=torch.int64, device=result_device))
        self.register_buffer("rows", torch.tensor(rows, dtype=torch.int64, device=result_device))
        self.register_buffer("columns", torch.tensor(columns, dtype=torch.int64, device=result_device))

    def forward(
        self,
        lengths: torch.Tensor,
        offsets: torch.Tensor,
        values: torch.Tensor,
        weights: Optional[torch.Tensor],
        batch: int,
        num_features: int,
        result_device: str,
        accumulate: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """This shard's pooled outputs [B, its columns] on ``result_device``; or, given ``accumulate``
        [B, all columns], that plus them at their columns (row blocks' partial sums)."""
        indices, offsets, weights = self.inputs(lengths, offsets, values, weights, batch, num_features)
        device = torch.device(self.device_name)
        out = self.tbe(indices.to(device), offsets.to(device), None if weights is None else weights.to(device))
        out = out.to(torch.device(result_device))
        if accumulate is not None:
            return accumulate.index_add(1, self.columns, out)
        return out

    def inputs(
        self,
        lengths: torch.Tensor,
        offsets: torch.Tensor,
        values: torch.Tensor,
        weights: Optional[torch.Tensor],
        batch: int,
        num_features: int,
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(indices, offsets, weights) of one shard's units, gathered from the request."""
        if self.all_in_order and not self.bucketed:
            return values, offsets, weights
        per_feature = lengths.view(num_features, batch)
        unit_lengths = per_feature.index_select(0, self.features)  # [U, B]
        unit_counts = unit_lengths.sum(1)
        starts = offsets.index_select(0, self.features * batch)  # where each unit's feature begins in values
        unit_starts = _complete_cumsum(unit_counts)[:-1]
        if self.same_size:
            total = values.shape[0]
            source = (starts - unit_starts).repeat_interleave(unit_counts, output_size=total)
        else:
            source = (starts - unit_starts).repeat_interleave(unit_counts)
            total = source.shape[0]
        source = source + torch.arange(total, dtype=torch.int64, device=values.device)
        indices = values.index_select(0, source)
        unit_weights = None if weights is None else weights.index_select(0, source)
        if self.bucketed:
            row_offset = self.row_offsets.repeat_interleave(unit_counts, output_size=total)
            rows = self.rows.repeat_interleave(unit_counts, output_size=total)
            rebased = indices - row_offset
            inside = (rebased >= 0) & (rebased < rows)
            indices = torch.where(inside, rebased, torch.zeros_like(rebased))
            mask = inside.to(torch.float32)
            unit_weights = mask if unit_weights is None else unit_weights * mask
        return indices, _complete_cumsum(unit_lengths.reshape(-1)), unit_weights


class FlatPooledLookup(nn.Module):
    """Pooled lookups of quantized (possibly sharded) tables on request tensors.

    forward(lengths [F*B] int (feature-major, the ``request_names`` features in that order),
            values [N] int, weights [N] float32 or None) -> [B, sum of dims] float32
    on the first shard's device, each output's ``dim`` columns in ``feature_names`` order (an output's name: its
    feature's, ``feature@table`` for a feature several tables look up; ``request_names[i]``: output i's feature).

    Build with ``FlatPooledLookup.of(module)`` from a QuantEmbeddingBagCollection or a
    ShardedQuantEmbeddingBagCollection.
    """

    feature_names: List[str]
    request_names: List[str]
    dims: List[int]
    mean_columns: torch.Tensor
    mean_per_feature: torch.Tensor
    order: torch.Tensor

    def __init__(
        self,
        feature_names: List[str],
        dims: List[int],
        table_rows: List[int],
        modulo: List[bool],
        mean_after: List[bool],
        weighted: bool,
        shards: List[_Shard],
        result_device: torch.device,
        request_names: Optional[List[str]] = None,
    ) -> None:
        super().__init__()
        self.feature_names = list(feature_names)
        self.request_names = list(feature_names if request_names is None else request_names)
        self.dims = list(dims)
        self.num_features = len(feature_names)
        self.total_dim = sum(dims)
        self.weighted = weighted
        self.shards = nn.ModuleList(shards)
        self.result_device = str(result_device)
        self.ids = IdCheck(self.request_names, table_rows, modulo, result_device)
        self.any_mean_after = any(mean_after)
        self.register_buffer(
            "mean_columns", torch.tensor([i for i, d in enumerate(dims) for _ in range(d)], dtype=torch.int64, device=result_device)
        )
        self.register_buffer("mean_per_feature", torch.tensor(mean_after, dtype=torch.bool, device=result_device))
        self.single = len(shards) == 1 and shards[0].all_in_order and shards[0].columns.tolist() == list(range(self.total_dim))
        self.summed = _has_row_blocks(shards)
        self.register_buffer(
            "order", torch.argsort(torch.cat([s.columns for s in shards])) if shards else torch.empty(0, dtype=torch.int64),
        )

    @staticmethod
    def of(module: nn.Module) -> "FlatPooledLookup":
        """The flat lookup of a QuantEmbeddingBagCollection or ShardedQuantEmbeddingBagCollection (rows shared)."""
        if isinstance(module, (ShardedQuantEmbeddingBagCollection, QuantEmbeddingBagCollection)):
            return _of_layout(module.lookup_layout())
        raise TypeError(f"FlatPooledLookup.of takes a (sharded) QuantEmbeddingBagCollection, got {type(module).__name__}")

    def forward(self, lengths: torch.Tensor, values: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        num_features = self.num_features
        batch = lengths.shape[0] // num_features
        device = torch.device(self.result_device)  # where the request is routed (a no-op where it already is)
        lengths = lengths.to(device=device, dtype=torch.int64)
        values = self.ids(values.to(device=device, dtype=torch.int64), lengths, batch)
        if not self.weighted:
            weights = None
        elif weights is not None:
            weights = weights.to(device=device, dtype=torch.float32)
        offsets = _complete_cumsum(lengths)
        if self.summed:
            result = torch.zeros(batch, self.total_dim, dtype=torch.float32, device=torch.device(self.result_device))
            for shard in self.shards:
                result = shard(lengths, offsets, values, weights, batch, num_features, self.result_device, result)
        else:
            outputs: List[torch.Tensor] = []
            for shard in self.shards:
                outputs.append(shard(lengths, offsets, values, weights, batch, num_features, self.result_device, None))
            if self.single:
                result = outputs[0]
            else:
                result = torch.cat(outputs, dim=1).index_select(1, self.order)
        if self.any_mean_after:
            per_feature = lengths.view(num_features, batch).t().to(torch.device(self.result_device))
            divisor = torch.where(self.mean_per_feature, per_feature.clamp(min=1), torch.ones_like(per_feature))
            result = result / divisor.index_select(1, self.mean_columns).to(result.dtype)
        return result


def _complete_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, dim=0)])


def _has_row_blocks(shards: List[_Shard]) -> bool:
    """Whether some output column is written by several shards (row blocks' partial sums)."""
    seen: set = set()
    for s in shards:
        for c in s.columns.tolist():
            if c in seen:
                return True
            seen.add(c)
    return False


def _column_starts(dims: List[int]) -> List[int]:
    starts, col = [], 0
    for d in dims:
        starts.append(col)
        col += d
    return starts


def _of_layout(layout: LookupLayout) -> FlatPooledLookup:
    index = {f: i for i, f in enumerate(layout.features)}
    col_start = _column_starts(layout.dims)
    result_device = layout.result_device or torch.device(FlatTBE(layout.groups[0].tbe).device_name)
    shards: List[_Shard] = []
    for g in layout.groups:
        columns = [col_start[index[f]] + c0 + j for f, c0, w in zip(g.features, g.col_offsets, g.cols) for j in range(w)]
        shards.append(_Shard(
            g.tbe, [index[f] for f in g.features],
            [o if b else 0 for o, b in zip(g.row_offsets, g.bucketed)],
            [n if b else (1 << 62) for n, b in zip(g.rows, g.bucketed)],  # a whole table: no id is outside the block
            columns, any(g.bucketed), len(layout.features), result_device,
        ))
    return FlatPooledLookup(layout.features, layout.dims, layout.rows, layout.modulo, layout.mean, layout.weighted, shards,
                            result_device, layout.requests)


class FlatEmbeddingBagCollection(nn.Module):
    """A quantized (sharded) EmbeddingBagCollection behind the collection's contract (KJT in,
    KeyedTensor out) that runs the flat lookup: for models whose forward hands it a KJT.

    A KJT with exactly the collection's features in order (what an exported model builds
    from the request) is looked up as it is; any other is gathered first.
    """

    def __init__(self, lookup: FlatPooledLookup) -> None:
        super().__init__()
        self.lookup = lookup
        self._keys = list(lookup.feature_names)
        self._requests = list(lookup.request_names)
        self._dims = list(lookup.dims)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        lengths, values, weights = _request_features(features, self._requests, not self.lookup.ids.asserts)
        pooled = self.lookup(lengths, values, weights)
        return KeyedTensor(keys=self._keys, length_per_key=self._dims, values=pooled, key_dim=1)


def _request_features(
    features: KeyedJaggedTensor, names: List[str], slices: bool = True
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(lengths [F*B], values, weights or None) of the ``names`` features of ``features``, in that order.

    A KJT with exactly these keys (what the exported model builds from a request for a lone
    collection) is used as it is; one that holds them among others (a model whose collections
    share the request KJT) has their segments gathered by position, without splitting it, or
    sliced when they are consecutive keys (``slices``: not while torch.export traces, where a
    slice at data-dependent bounds is an unbacked size; the gather is not).
    """
    keys = features.keys()
    lengths, values, weights = features.lengths(), features.values(), features.weights_or_none()
    if keys == names:
        return lengths, values, weights
    positions: List[int] = []
    for name in names:
        if name not in keys:
            raise ValueError(f"input KeyedJaggedTensor lacks feature '{name}'; it has {keys}")
        positions.append(keys.index(name))
    batch = lengths.shape[0] // len(keys)
    first = positions[0]
    if slices and positions == list(range(first, first + len(positions))):
        # a run of consecutive keys (a model's collections splitting the request KJT): views, no gather
        start, end = first * batch, (first + len(positions)) * batch
        bounds: List[int] = torch.stack([lengths[:start].sum(), lengths[:end].sum()]).tolist()
        return (lengths[start:end], values[bounds[0] : bounds[1]],
                None if weights is None else weights[bounds[0] : bounds[1]])
    per_key = lengths.view(len(keys), batch)
    chosen = torch.tensor(positions, dtype=torch.int64, device=lengths.device)
    sub_lengths = per_key.index_select(0, chosen)  # [len(names), B]
    counts = sub_lengths.to(torch.int64).sum(1)
    key_starts = _complete_cumsum(per_key.to(torch.int64).sum(1))[:-1].index_select(0, chosen)
    sub_starts = _complete_cumsum(counts)[:-1]
    source = (key_starts - sub_starts).repeat_interleave(counts)
    source = source + torch.arange(source.shape[0], dtype=torch.int64, device=values.device)
    return sub_lengths.reshape(-1), values.index_select(0, source), None if weights is None else weights.index_select(0, source)


class FlatEmbeddingCollection(nn.Module):
    """A QuantEmbeddingCollection behind its contract (KJT in, {feature: JaggedTensor of [n, dim]
    float32 rows} out) that calls fbgemm's unpooled lookup on the request tensors.

    Built with ``FlatEmbeddingCollection.of(module)``; rows shared with ``module``.
    """

    feature_names: List[str]
    request_names: List[str]

    def __init__(self, feature_names: List[str], table_rows: List[int], modulo: List[bool], shards: List[_Shard],
                 request_names: Optional[List[str]] = None) -> None:
        super().__init__()
        self.feature_names = list(feature_names)  # the outputs: feature@table for a shared feature
        self.request_names = list(feature_names if request_names is None else request_names)  # each output's feature
        self.num_features = len(feature_names)
        self.device_name = shards[0].device_name if shards else "cpu"
        self.ids = IdCheck(self.request_names, table_rows, modulo, torch.device(self.device_name))
        self.shards = nn.ModuleList([_UnpooledShard(s) for s in shards])
        self._unit_features: List[List[int]] = [s.features.tolist() for s in shards]  # request feature of each unit

    @staticmethod
    def of(module: nn.Module) -> "FlatEmbeddingCollection":
        if not isinstance(module, QuantEmbeddingCollection):
            raise TypeError(f"FlatEmbeddingCollection.of takes a QuantEmbeddingCollection, got {type(module).__name__}")
        layout = module.lookup_layout()
        index = {f: i for i, f in enumerate(layout.features)}
        shards = []
        for g in layout.groups:  # each TBE answers on the device it keeps its rows on
            device = torch.device(FlatTBE(g.tbe).device_name)
            shards.append(_Shard(g.tbe, [index[f] for f in g.features], [0] * len(g.features), [1 << 62] * len(g.features), [],
                                 False, len(layout.features), device))
        return FlatEmbeddingCollection(layout.features, layout.rows, layout.modulo, shards, layout.requests)

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        lengths, values, _ = _request_features(features, self.request_names, not self.ids.asserts)
        batch = lengths.shape[0] // self.num_features
        given = lengths.view(self.num_features, batch)  # the JaggedTensors keep the request's dtype
        device = torch.device(self.device_name)
        lengths = lengths.to(device=device, dtype=torch.int64)
        values = self.ids(values.to(device=device, dtype=torch.int64), lengths, batch)
        offsets = _complete_cumsum(lengths)
        found: Dict[str, JaggedTensor] = {}
        k = 0
        for shard in self.shards:
            parts = shard(lengths, offsets, values, batch, self.num_features)
            u = 0
            for f in self._unit_features[k]:
                found[self.feature_names[f]] = JaggedTensor(values=parts[u], weights=None, lengths=given[f], offsets=None)
                u += 1
            k += 1
        out: Dict[str, JaggedTensor] = {}
        for name in self.feature_names:
            out[name] = found[name]
        return out


class _UnpooledShard(nn.Module):
    """A _Shard of an unpooled TBE: forward -> each unit's rows [its ids, dim]."""

    def __init__(self, shard: _Shard) -> None:
        super().__init__()
        self.shard = shard

    def forward(
        self, lengths: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, batch: int, num_features: int
    ) -> List[torch.Tensor]:
        indices, unit_offsets, _ = self.shard.inputs(lengths, offsets, values, None, batch, num_features)
        device = torch.device(self.shard.device_name)
        rows = self.shard.tbe(indices.to(device), unit_offsets.to(device), None)
        counts: List[int] = lengths.view(num_features, batch).index_select(0, self.shard.features).sum(1).tolist()
        return list(torch.split(rows, counts))


def flatten_collections(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose quantized collections (plain or inference-sharded) are their flat
    twins; everything else is deep-copied, the tables' rows are shared with ``model``."""
    memo: Dict[int, object] = {}
    for m in model.modules():
        if id(m) in memo:
            continue
        if isinstance(m, QuantFeatureProcessedEmbeddingBagCollection):  # its processors (copied), then its flat tables
            memo[id(m)] = FeatureProcessedLookup(copy.deepcopy(m.feature_processor), FlatEmbeddingBagCollection(FlatPooledLookup.of(m)))
        elif isinstance(m, (QuantEmbeddingBagCollection, ShardedQuantEmbeddingBagCollection)):
            memo[id(m)] = FlatEmbeddingBagCollection(FlatPooledLookup.of(m))
        elif isinstance(m, QuantEmbeddingCollection):
            memo[id(m)] = FlatEmbeddingCollection.of(m)
    if id(model) in memo:
        return memo[id(model)]  # type: ignore[return-value]
    return copy.deepcopy(model, memo)
