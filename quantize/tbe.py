"""The tables of the quantized collections in fbgemm's inference TBE (``QuantTables``), and the checks
before the kernel.

All tables with the same pooling share one ``IntNBitTableBatchedEmbeddingBagsCodegen`` (a TBE holds
mixed weight types), so a module makes at most two kernel calls (SUM and MEAN).

Ids are validated before the kernel: an id outside its table is an error naming
feature, table, id and size (fbgemm's default bounds check would silently rewrite
it to row 0), unless that feature's id policy is "modulo", which hashes ids into
the table. The kernel's own check runs in FATAL mode as a second line.

fbgemm keeps the quantized rows in ``weights_host``, a plain attribute that
``state_dict()`` does not see. Each table's stored rows are registered as a buffer
under TorchRec's names, ``embedding_bags.<table>.weight`` (``embeddings.<table>.weight``
for the unpooled module): a [rows, row bytes] uint8 view of the TBE's storage, full
rows as the kernel reads them (fp16 scale | fp16 bias | packed data | alignment
padding for the integer types). The views are the only copy of the rows: state_dict,
load_state_dict, pickling and TorchScript save/load all keep them aliased to the TBE.
The TBE's own buffers are non-persistent, so state_dict's keys are exactly TorchRec's
(``embedding_bags.<table>.weight``; no ``tbes.*``).
"""

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
import torch
from torch import nn

from recship.names import ID_POLICIES
from recship.quantize.quantizer import HostRows, check_output_dtype, require_float32_output
from recship.quantize.rowwise import FP8_EXPONENT_BIAS, FP8_EXPONENT_BITS
from recship.sparse import KeyedJaggedTensor
from recship.sparse.ids import check_id_dtype, first_out_of_range, out_of_range_message
from recship.modules.embedding_configs import BaseEmbeddingConfig
from recship.modules.embedding_modules import get_embedding_names_by_table
from recship.modules.types import DataType


@torch.fx.wrap
def check_ids(
    ids: torch.Tensor,
    counts: List[int],
    rows: List[int],
    modulo: List[bool],
    features: List[str],
    tables: List[str],
) -> torch.Tensor:
    """ids [N] (any integer dtype) of consecutive features, counts[i] ids each, checked against
    rows[i] -> [N] int64; ids of modulo features are hashed into their table, any other id
    outside its table raises ValueError (the id rule's message, recship.sparse.ids).

    One min and one max per feature (no per-id temporaries); ids are copied only when a
    modulo feature has ids to hash.
    """
    check_id_dtype(ids, "quantized embedding lookup")  # before the cast: a float id must not truncate to a row
    ids = ids.to(torch.int64)
    if ids.numel() == 0:
        return ids
    # one pass over all ids settles the usual case: everything inside the smallest table
    lowest, highest = torch.aminmax(ids)
    if int(lowest) >= 0 and int(highest) < min(rows):
        return ids
    copied = False
    start = 0
    for i in range(len(counts)):
        n = counts[i]
        if n > 0:
            segment = ids[start : start + n]
            bad = first_out_of_range(segment, rows[i])
            if bad is not None:
                if not modulo[i]:
                    raise ValueError(out_of_range_message(features[i], bad, rows[i]))
                if not copied:
                    ids = ids.clone()
                    copied = True
                ids[start : start + n] = torch.remainder(segment, rows[i])
        start += n
    return ids


@torch.fx.wrap
def _prepare(
    features: KeyedJaggedTensor,
    names: List[str],
    rows: List[int],
    modulo: List[bool],
    tables: List[str],
    weighted: bool,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], List[int]]:
    """(checked ids, offsets, per-sample weights, ids per feature) of the ``names`` features.

    When the KJT holds exactly these features in this order (the usual request), its
    tensors are used as they are; otherwise the features are gathered. fx records this
    as one call, so tracing does not depend on the input's keys.
    """
    counts: List[int] = []
    if features.keys() == names:
        counts = features.length_per_key()
        ids = features.values()
        offsets = features.offsets().to(torch.int64)
        per_sample_weights: Optional[torch.Tensor] = None
        if weighted:
            per_sample_weights = features.weights().float()
    else:
        # per-key views of the KJT's tensors (what to_dict gives, without a checked JaggedTensor per key);
        # a repeated key resolves to its last occurrence, as in to_dict
        index = features.index_per_key()
        length_per_key = features.length_per_key()
        values_per_key = torch.split(features.values(), length_per_key)
        lengths_per_key = features.lengths().view(len(features.keys()), features.stride())
        weights_per_key: List[torch.Tensor] = []
        ids_parts: List[torch.Tensor] = []
        length_parts: List[torch.Tensor] = []
        weight_parts: List[torch.Tensor] = []
        for name in names:
            if name not in index:
                raise ValueError(f"input KeyedJaggedTensor lacks feature '{name}'; it has {features.keys()}")
            k = index[name]
            ids_parts.append(values_per_key[k])
            length_parts.append(lengths_per_key[k])
            counts.append(length_per_key[k])
            if weighted:
                if len(weights_per_key) == 0:
                    weights_per_key = list(torch.split(features.weights(), length_per_key))
                weight_parts.append(weights_per_key[k])
        ids = torch.cat(ids_parts)
        lengths = torch.cat(length_parts).to(torch.int64)
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, dim=0)])
        per_sample_weights = torch.cat(weight_parts).float() if weighted else None
    ids = check_ids(ids, counts, rows, modulo, names, tables)
    return ids, offsets, per_sample_weights, counts


def _initialize_weights(tbe: Any, allocate: Optional[HostRows]) -> None:
    """``tbe.initialize_weights()``, with its host rows from ``allocate`` (if given) instead of its own zeros
    (which would be filled and then dropped: seconds at GBs of rows)."""
    host = int(tbe.host_size)
    if allocate is None or host == 0:
        tbe.initialize_weights()
        return
    # fbgemm 1.8's initialize_weights is _apply_split of these attributes; with no host bytes it allocates none
    tbe._apply_split(tbe.dev_size, 0, tbe.uvm_size, tbe.weights_physical_placements, tbe.weights_physical_offsets, tbe.enforce_hbm)
    tbe.host_size = host
    tbe.weights_host = allocate(host)


@dataclass
class LookupGroup:
    """One TBE of a collection and what it looks up, unit by unit (in its feature order): unit u feeds the
    collection's output ``features[u]`` (a name of ``LookupLayout.features``); when ``bucketed[u]``, only rows
    [row_offsets[u], row_offsets[u] + rows[u]) of its table
    (a row block, ids rebased); its output columns are [col_offsets[u], col_offsets[u] + cols[u]) of the feature's
    embedding."""

    tbe: nn.Module
    features: List[str]
    row_offsets: List[int]
    rows: List[int]
    bucketed: List[bool]
    col_offsets: List[int]
    cols: List[int]


@dataclass
class LookupLayout:
    """How a quantized (or inference-sharded) EmbeddingBagCollection answers a request, for the flat lookup
    (``recship.quantize.flat``) to run the same TBEs on the request tensors: its outputs in order (a feature's
    name, ``feature@table`` for a shared feature) with their dims, table rows and id policy (``modulo``), whether
    their MEAN is divided after merging row blocks (``mean``), whether ids carry weights, its TBEs (``groups``),
    where results are merged (None: where the first TBE keeps its rows), and the request feature each output
    reads (``requests``: the feature itself, or a shared feature's name for each of its tables)."""

    features: List[str]
    dims: List[int]
    rows: List[int]
    modulo: List[bool]
    mean: List[bool]
    weighted: bool
    groups: List[LookupGroup]
    result_device: Optional[torch.device]
    requests: List[str]


class QuantTables(nn.Module):
    """Tables in fbgemm inference TBEs, one TBE per group of tables; shared by the two modules."""

    _group_names: List[List[str]]
    _group_features: List[List[str]]
    _group_rows: List[List[int]]
    _group_tables: List[List[str]]
    _group_modulo: List[List[bool]]

    def _build(
        self,
        tables: Sequence[BaseEmbeddingConfig],
        groups: Sequence[Tuple[object, Sequence[BaseEmbeddingConfig]]],
        weight_types: Dict[str, DataType],
        device: torch.device,
        row_alignment: Optional[int],
        id_policy: Optional[Dict[str, str]],
        rows_container: str,
        output_dtype: torch.dtype = torch.float32,
        host_rows: Optional[HostRows] = None,
    ) -> None:
        """groups: [(fbgemm PoolingMode, tables)] in the order their outputs are produced.

        rows_container: the ModuleDict (``embedding_bags`` / ``embeddings``) whose
        ``<table>.weight`` buffers expose each table's stored rows.
        output_dtype: what the TBEs answer in (float32, float16, bfloat16): fbgemm pools in float32 and
            converts the result, as TorchRec's collections do with the same ``output_dtype``.
        host_rows: where the TBEs keep their host rows (``HostRows``); None: fbgemm's own zeros.
        """
        self.row_alignment = row_alignment if row_alignment is not None else (16 if device.type == "cuda" else 1)
        self._output_dtype = check_output_dtype(output_dtype)
        self._device = torch.device(device)
        id_policy = dict(id_policy or {})
        all_features = [f for t in tables for f in t.feature_names]
        for f, policy in id_policy.items():
            if f not in all_features:
                raise ValueError(f"id_policy names feature {f!r}, which no table has")
            if policy not in ID_POLICIES:
                raise ValueError(f"feature {f!r}: id policy must be one of {ID_POLICIES}, got {policy!r}")
        for t in tables:
            dt = weight_types.get(t.name)
            if dt is None:
                raise ValueError(f"no weight type for table {t.name!r}")
            if dt == DataType.BF16:
                raise ValueError(f"table {t.name!r}: BF16 is not supported by fbgemm's inference TBE; use FP16")
        self._tables = list(tables)
        self._weight_types = {t.name: weight_types[t.name] for t in tables}
        self.id_policy = {f: id_policy.get(f, "reject") for f in all_features}
        location = EmbeddingLocation.DEVICE if device.type == "cuda" else EmbeddingLocation.HOST
        rows = nn.ModuleDict({t.name: nn.Module() for t in tables})  # in table order, as the float module's
        setattr(self, rows_container, rows)
        self.tbes = nn.ModuleList()
        self._rows_container = rows_container
        self._tbe_state_keys: List[List[str]] = []
        self._register_load_state_dict_pre_hook(self._packed_rows_as_bytes)
        self._group_features = []
        self._group_names = []  # the outputs' names: the features', ``feature@table`` for a shared feature
        output_names = dict(zip((t.name for t in tables), get_embedding_names_by_table(list(tables))))
        self._group_rows = []
        self._group_tables = []
        self._group_modulo = []
        for pooling_mode, group in groups:
            tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
                embedding_specs=[
                    (t.name, t.num_embeddings, t.embedding_dim, self._weight_types[t.name].to_sparse_type(), location)
                    for t in group
                ],
                feature_table_map=[i for i, t in enumerate(group) for _ in t.feature_names],
                pooling_mode=pooling_mode,
                device=device,
                bounds_check_mode=BoundsCheckMode.FATAL,
                output_dtype={torch.float32: SparseType.FP32, torch.float16: SparseType.FP16,
                              torch.bfloat16: SparseType.BF16}[self._output_dtype],
                row_alignment=self.row_alignment,
                fp8_exponent_bits=FP8_EXPONENT_BITS,
                fp8_exponent_bias=FP8_EXPONENT_BIAS,
            )
            _initialize_weights(tbe, host_rows)
            self._tbe_state_keys.append(list(tbe.state_dict(keep_vars=True)))  # fbgemm's persistent buffers
            _set_persistence(tbe, self._tbe_state_keys[-1], False)
            # weights_host is a plain attribute of the TBE: per-table views of it as buffers put the
            # rows in state_dict (mode 0: whole padded rows, scale/bias included)
            for t, (stored, _, _) in zip(group, tbe.split_embedding_weights_with_scale_bias(split_scale_bias_mode=0)):
                rows[t.name].register_buffer("weight", stored)
            self.tbes.append(tbe)
            self._group_features.append([f for t in group for f in t.feature_names])
            self._group_names.append([name for t in group for name in output_names[t.name]])
            self._group_rows.append([t.num_embeddings for t in group for _ in t.feature_names])
            self._group_tables.append([t.name for t in group for _ in t.feature_names])
            self._group_modulo.append([self.id_policy[f] == "modulo" for t in group for f in t.feature_names])

    def _layout(self, names: List[str], dims: Dict[str, int], weighted: bool) -> LookupLayout:
        """The flat lookup's view of these TBEs, outputs in ``names`` order (``dims``: their widths): whole tables,
        no row blocks, each TBE pooling (or gathering) itself."""
        rows: Dict[str, int] = {}
        request: Dict[str, str] = {}
        for outputs, features, table_rows in zip(self._group_names, self._group_features, self._group_rows):
            for name, feature, n in zip(outputs, features, table_rows):
                rows[name], request[name] = n, feature
        groups = [LookupGroup(tbe, list(ns), [0] * len(ns), [rows[n] for n in ns], [False] * len(ns), [0] * len(ns),
                              [dims[n] for n in ns]) for tbe, ns in zip(self.tbes, self._group_names)]
        return LookupLayout(list(names), [dims[n] for n in names], [rows[n] for n in names],
                            [self.id_policy.get(request[n], "reject") == "modulo" for n in names], [False] * len(names),
                            weighted, groups, None, [request[n] for n in names])

    def output_dtype(self) -> torch.dtype:
        """The dtype of the lookups' results (TorchRec's ``output_dtype()``)."""
        return self._output_dtype

    def _require_float32_output(self, what: str) -> None:
        require_float32_output(self._output_dtype, what)

    @property
    def device(self) -> torch.device:
        """The device the tables were built on (TorchRec's ``device``; a collection quantized from ``meta`` is on the CPU)."""
        return self._device

    def _prepare(
        self, g: int, features: KeyedJaggedTensor, weighted: bool
    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], List[int]]:
        return _prepare(
            features, self._group_features[g], self._group_rows[g], self._group_modulo[g], self._group_tables[g], weighted
        )

    def set_state_dict_layout(self, split_scale_bias: bool = False, register_tbes: bool = False) -> None:
        """TorchRec's two state_dict options of a quantized collection (default: neither).

        split_scale_bias (TorchRec's ``quant_state_dict_split_scale_bias``): ``<table>.weight`` is
            the packed data alone, [rows, data bytes] uint8, and integer tables add
            ``weight_qscale`` and ``weight_qbias``, [rows, 1] fp16 (views of the same rows).
        register_tbes (TorchRec's ``register_tbes``): the TBEs' own buffers join state_dict as
            ``tbes.<i>.*``.
        """
        rows = getattr(self, self._rows_container)
        for tbe, names in zip(self._kernels(), _unique_in_order(self._group_tables)):
            mode = 2 if split_scale_bias else 0
            for name, (weight, qscale, qbias) in zip(names, tbe.split_embedding_weights_with_scale_bias(split_scale_bias_mode=mode)):
                holder = rows[name]
                holder.register_buffer("weight", weight)
                for attr in ("weight_qscale", "weight_qbias"):
                    if hasattr(holder, attr):
                        delattr(holder, attr)
                if split_scale_bias and qscale is not None:
                    holder.register_buffer("weight_qscale", qscale)
                    holder.register_buffer("weight_qbias", qbias)
        for tbe, keys in zip(self._kernels(), self._tbe_state_keys):
            _set_persistence(tbe, keys, register_tbes)

    def _fill(self, weights: Optional[Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]], register_tbes: bool,
              split_scale_bias: bool) -> None:
        """The constructors' TorchRec arguments: the given stored rows copied in, then the state_dict layout."""
        if weights is not None:
            self.assign_table_weights(weights)
        if register_tbes or split_scale_bias:
            self.set_state_dict_layout(split_scale_bias=split_scale_bias, register_tbes=register_tbes)

    def assign_table_weights(self, weights: Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]) -> None:
        """Copies table -> (packed rows [rows, data bytes] uint8, scale/bias [rows, 4] uint8 or None), as TorchRec's
        ``quantize_state_dict`` gives them, into the stored rows (their row-alignment padding untouched);
        ValueError names a table the collection lacks or whose shapes do not fit."""
        stored = self.table_weights()
        unknown = sorted(set(weights) - set(stored))
        if unknown:
            raise ValueError(f"quantized weights for tables {unknown}, which the collection lacks; it has {sorted(stored)}")
        for name, (data, scale_bias) in weights.items():
            dest, dest_sb = stored[name]
            if (data.dim() != 2 or data.shape[0] != dest.shape[0] or data.view(torch.uint8).shape[1] > dest.shape[1]
                    or (scale_bias is None) != (dest_sb is None)):
                raise ValueError(f"table {name!r}: quantized rows {tuple(data.shape)} (scale/bias {scale_bias is not None}) do not "
                                 f"fit its stored rows {tuple(dest.shape)} (scale/bias {dest_sb is not None})")
            packed = data.view(torch.uint8)
            dest[:, : packed.shape[1]].copy_(packed)
            if scale_bias is not None and dest_sb is not None:
                dest_sb.copy_(scale_bias)

    def _packed_rows_as_bytes(self, state_dict: Dict[str, Any], prefix: str, *_: Any) -> None:
        """Reads TorchRec's INT4 / INT2 rows as the bytes they are (load_state_dict pre-hook).

        TorchRec stores those tables as ``UInt4Tensor`` / ``UInt2Tensor``: the same bytes as
        recship's rows, shown as [rows, row bytes * 2 (or * 4)] values, the bytes behind
        ``.view(torch.uint8)``. recship's buffers are the plain [rows, row bytes] uint8.
        """
        for t in self._tables:
            if self._weight_types[t.name] not in (DataType.INT4, DataType.INT2):
                continue
            key = f"{prefix}{self._rows_container}.{t.name}.weight"
            given = state_dict.get(key)
            if isinstance(given, torch.Tensor) and type(given) is not torch.Tensor and given.dtype == torch.uint8:
                state_dict[key] = given.view(torch.uint8)

    # -- weights -----------------------------------------------------------

    def _kernels(self) -> List[Any]:
        """``self.tbes`` as the fbgemm TBEs ``_build`` put there (fbgemm is untyped: Any to mypy)."""
        kernels = []
        for tbe in self.tbes:
            assert isinstance(tbe, IntNBitTableBatchedEmbeddingBagsCodegen), type(tbe)
            kernels.append(tbe)
        return kernels

    def table_weights(self) -> Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """table -> (packed rows [rows, bytes] uint8, scale_bias [rows, 4] uint8 or None): writable views."""
        out: Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
        for tbe, tables in zip(self._kernels(), _unique_in_order(self._group_tables)):
            for name, (data, scale_bias) in zip(tables, tbe.split_embedding_weights()):
                out[name] = (data, scale_bias)
        return out

    def _kernel_tables(self) -> List[List[str]]:
        """The table names of each TBE, in ``self.tbes`` order."""
        return _unique_in_order(self._group_tables)

    def weight_types(self) -> Dict[str, DataType]:
        return dict(self._weight_types)

    def tables(self) -> List[BaseEmbeddingConfig]:
        return list(self._tables)

    def _stored_configs(self) -> List[BaseEmbeddingConfig]:
        """The tables' configs with ``data_type`` the type each is stored in."""
        return [replace(t, data_type=self._weight_types[t.name]) for t in self._tables]

    def weight_bytes(self) -> int:
        """Bytes of every TBE's stored rows, alignment padding included."""
        return sum(int(tbe.weights_host.numel() + tbe.weights_dev.numel() + tbe.weights_uvm.numel()) for tbe in self._kernels())




def _set_persistence(tbe: nn.Module, keys: List[str], persistent: bool) -> None:
    """Re-registers the TBE's buffers ``keys`` (those fbgemm made persistent) as ``persistent`` or not.

    TorchRec's quantized collections (``register_tbes=False``, its default) hold only the per-table
    ``<container>.<table>.weight`` rows in their state_dict; the TBE's buffers (``D_offsets``,
    ``weights_tys``, remapping arrays, ...) are kernel metadata rebuilt from the table configs.
    Non-persistent, they stay in ``named_buffers()``, TorchScript and pickles, but out of
    ``state_dict()``, so the keys are TorchRec's and strict loads work both ways.
    """
    for key in keys:
        path, _, name = key.rpartition(".")
        module = tbe.get_submodule(path) if path else tbe
        buffers = dict(module.named_buffers(recurse=False))
        if name in buffers:
            module.register_buffer(name, buffers[name], persistent=persistent)


def _unique_in_order(groups: List[List[str]]) -> List[List[str]]:
    out = []
    for g in groups:
        seen: List[str] = []
        for name in g:
            if name not in seen:
                seen.append(name)
        out.append(seen)
    return out
