"""QuantEmbeddingBagCollection / QuantEmbeddingCollection: quantized tables in fbgemm's inference TBE
(``recship.quantize.tbe``), and the functions that build them from float collections.

Same contract as the float EmbeddingBagCollection: KJT in, KeyedTensor out (keys
in table order, float32 values; float16 / bfloat16 with TorchRec's ``output_dtype``, for eager use only: the
flat lookup behind export and serving, and inference sharding, take float32 collections).
``quantize_embeddings`` swaps every float collection of a model for its quantized twin; ``quantize_embedding_bag_collection`` /
``quantize_embedding_collection`` quantize one; ``from_float`` is TorchRec's way to the same.
Each table is quantized by ``recship.quantize.quantizer`` (types, rows, error report).
"""

import copy
import dataclasses
import functools
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type, TypeVar, Union, cast, overload

from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
import torch
from torch import nn
from torch.ao.quantization import QConfig

from recship.quantize.quantizer import (BlockView, HostRows, QuantConfig, QuantizationReport, TableHook, TableLoader, TableReport,
                                        choose_types, quantize_into, require_float32_output)
from recship.quantize.tbe import LookupLayout, QuantTables
from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from recship.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection, get_embedding_names_by_table
from recship.modules.types import DataType, PoolingType


# TorchRec pads quantized rows to 16 bytes on every device (its DEFAULT_ROW_ALIGNMENT); from_float and the constructors
# do the same by default, so a tutorial's buffers and state_dicts have TorchRec's shapes (the CPU kernel reads either)
TORCHREC_ROW_ALIGNMENT = 16

StoredRows = Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]


class QuantEmbeddingBagCollection(QuantTables):
    """Quantized pooled lookups: KJT in, KeyedTensor (``output_dtype``, float32 by default) out.

    TorchRec's constructor (``torchrec.quant.embedding_modules.EmbeddingBagCollection``):

    Args:
        tables: the table configs; each table is stored in its ``data_type`` (INT8, INT4, INT2, FP8, FP16, FP32).
        is_weighted: use the KJT's weights as per-id scores.
        device: "cpu" or a CUDA device.
        output_dtype: the outputs' dtype, torch.float, torch.half or torch.bfloat16 (fbgemm pools in float32 and
            converts, as for TorchRec's); export, serving and inference sharding take torch.float only.
        table_name_to_quantized_weights: table -> (packed rows [rows, data bytes] uint8, scale/bias [rows, 4] uint8
            or None), as TorchRec's ``quantize_state_dict`` gives them; None: rows zero, to be loaded.
        register_tbes, quant_state_dict_split_scale_bias: the state_dict layout (``set_state_dict_layout``).
        row_alignment: bytes each row is padded to (TorchRec's 16); None: 1 on CPU, 16 on CUDA.
        cache_features_order: accepted; recship looks features up by name, so it changes nothing.
        weight_types: (recship) table -> DataType, instead of the configs' ``data_type``.
        id_policy: (recship) feature -> "reject" (default) or "modulo".
        host_rows: (recship) where the rows are allocated on the host (``recship.quantize.HostRows``).
    """

    _names: List[str]
    _dims: List[int]
    _column_order: torch.Tensor  # buffer [sum of dims] int64

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool,
        device: Union[str, torch.device],
        output_dtype: torch.dtype = torch.float,
        table_name_to_quantized_weights: Optional[StoredRows] = None,
        register_tbes: bool = False,
        quant_state_dict_split_scale_bias: bool = False,
        row_alignment: Optional[int] = TORCHREC_ROW_ALIGNMENT,
        cache_features_order: bool = False,
        *,
        weight_types: Optional[Dict[str, DataType]] = None,
        id_policy: Optional[Dict[str, str]] = None,
        host_rows: Optional[HostRows] = None,
    ) -> None:
        super().__init__()

        modes = {PoolingType.SUM: PoolingMode.SUM, PoolingType.MEAN: PoolingMode.MEAN}
        groups = [(modes[p], [t for t in tables if t.pooling == p]) for p in (PoolingType.SUM, PoolingType.MEAN)]
        types = weight_types if weight_types is not None else {t.name: t.data_type for t in tables}
        self._build(tables, [g for g in groups if g[1]], types, torch.device(device), row_alignment, id_policy, "embedding_bags",
                    output_dtype, host_rows)
        self._is_weighted = is_weighted
        self._fill(table_name_to_quantized_weights, register_tbes, quant_state_dict_split_scale_bias)
        # output columns: the groups' outputs reordered into table order
        self._names = [name for names in get_embedding_names_by_table(tables) for name in names]
        self._dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        group_order = [name for names in self._group_names for name in names]
        self._needs_reorder = group_order != self._names
        self.register_buffer(
            "_column_order", _column_permutation(group_order, self._names, dict(zip(self._names, self._dims))), persistent=False
        )

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        outputs: List[torch.Tensor] = []
        g = 0
        for tbe in self.tbes:
            prepared = self._prepare(g, features, self._is_weighted)
            outputs.append(tbe(prepared[0], prepared[1], prepared[2]))
            g += 1
        values = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
        if self._needs_reorder:
            values = values.index_select(1, self._column_order)
        return KeyedTensor(keys=self._names, length_per_key=self._dims, values=values, key_dim=1)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def lookup_layout(self) -> LookupLayout:
        """Its TBEs as the flat lookup runs them: whole tables (no row blocks), each TBE pooling itself."""
        self._require_float32_output("the flat lookup (export, serving)")
        return self._layout(self._names, dict(zip(self._names, self._dims)), self._is_weighted)

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        """The tables, each with the type it is stored in (``data_type``: INT8, INT4, ...), as TorchRec's."""
        # __init__ passed its EmbeddingBagConfigs to _build, which keeps them as the shared base type
        return cast(List[EmbeddingBagConfig], self._stored_configs())

    @classmethod
    def from_float(cls, module: nn.Module, use_precomputed_fake_quant: bool = False) -> "QuantEmbeddingBagCollection":
        """The quantized twin of a float EmbeddingBagCollection that carries a ``qconfig``.

        What torch's ``quantize_dynamic`` / ``convert`` call with
        ``mapping={EmbeddingBagCollection: QuantEmbeddingBagCollection}``; the qconfig is a
        QuantConfig (or torch's QConfig, read as ``QuantConfig(activation=, weight=)``).
        Rows are padded to TorchRec's 16 bytes unless ``qconfig.row_alignment`` says
        otherwise. TorchRec's ``quant_prep_enable_quant_state_dict_split_scale_bias`` /
        ``quant_prep_enable_register_tbes`` on ``module`` choose the state_dict's layout. ``use_precomputed_fake_quant`` is accepted for torch's signature and
        unused (no fake-quant observers are involved).
        """
        return quantize_from_float(cls, module)


class QuantEmbeddingCollection(QuantTables):
    """Quantized unpooled lookups: KJT in, {feature: JaggedTensor of [N, dim] rows (``output_dtype``)} out.

    Tables of equal dim share one TBE (fbgemm's unpooled mode needs one width). TorchRec's constructor; arguments
    as for QuantEmbeddingBagCollection (no weights: rows are not pooled), and ``need_indices``: each output
    JaggedTensor carries its ids as ``weights()``, as TorchRec's.
    """

    _names: List[str]

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        device: Union[str, torch.device],
        need_indices: bool = False,
        output_dtype: torch.dtype = torch.float,
        table_name_to_quantized_weights: Optional[StoredRows] = None,
        register_tbes: bool = False,
        quant_state_dict_split_scale_bias: bool = False,
        row_alignment: Optional[int] = TORCHREC_ROW_ALIGNMENT,
        cache_features_order: bool = False,
        *,
        weight_types: Optional[Dict[str, DataType]] = None,
        id_policy: Optional[Dict[str, str]] = None,
        host_rows: Optional[HostRows] = None,
    ) -> None:
        super().__init__()

        dims = sorted({t.embedding_dim for t in tables})
        groups = [(PoolingMode.NONE, [t for t in tables if t.embedding_dim == d]) for d in dims]
        types = weight_types if weight_types is not None else {t.name: t.data_type for t in tables}
        self._build(tables, groups, types, torch.device(device), row_alignment, id_policy, "embeddings", output_dtype, host_rows)
        self._names = [name for names in get_embedding_names_by_table(tables) for name in names]
        self._need_indices = need_indices
        self._fill(table_name_to_quantized_weights, register_tbes, quant_state_dict_split_scale_bias)

    def need_indices(self) -> bool:
        return self._need_indices

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        per_feature = features.to_dict()
        found: Dict[str, JaggedTensor] = {}
        g = 0
        for tbe in self.tbes:
            prepared = self._prepare(g, features, False)
            rows = torch.split(tbe(prepared[0], prepared[1], None), prepared[3])
            for i, name in enumerate(self._group_names[g]):
                jt = per_feature[self._group_features[g][i]]
                found[name] = JaggedTensor(values=rows[i], weights=jt.values() if self._need_indices else None, lengths=jt.lengths(),
                                           offsets=jt.offsets())
            g += 1
        out: Dict[str, JaggedTensor] = {}
        for name in self._names:
            out[name] = found[name]
        return out

    def lookup_layout(self) -> LookupLayout:
        """Its TBEs as the flat lookup runs them: whole tables, rows unpooled (``dims``: each feature's row width)."""
        self._require_float32_output("the flat lookup (export, serving)")
        names = get_embedding_names_by_table(self._tables)
        dims = {name: t.embedding_dim for t, table_names in zip(self._tables, names) for name in table_names}
        return self._layout(self._names, dims, False)

    def embedding_configs(self) -> List[EmbeddingConfig]:
        """The tables, each with the type it is stored in (``data_type``), as TorchRec's."""
        # __init__ passed its EmbeddingConfigs to _build, which keeps them as the shared base type
        return cast(List[EmbeddingConfig], self._stored_configs())

    @classmethod
    def from_float(cls, module: nn.Module, use_precomputed_fake_quant: bool = False) -> "QuantEmbeddingCollection":
        """The quantized twin of a float EmbeddingCollection that carries a ``qconfig``;
        see ``QuantEmbeddingBagCollection.from_float``."""
        return quantize_from_float(cls, module)


def _column_permutation(source: List[str], target: List[str], dims: Dict[str, int]) -> torch.Tensor:
    """Column indices that turn outputs concatenated in ``source`` order into ``target`` order."""
    start: Dict[str, int] = {}
    col = 0
    for name in source:
        start[name] = col
        col += dims[name]
    return torch.cat([torch.arange(start[n], start[n] + dims[n]) for n in target])


QuantModule = Union["QuantEmbeddingBagCollection", "QuantEmbeddingCollection"]
FloatCollection = Union[EmbeddingBagCollection, EmbeddingCollection]


Q = TypeVar("Q", QuantEmbeddingBagCollection, QuantEmbeddingCollection)


# Where a collection's quantized rows go: (its tables, their chosen types, is_weighted, the QuantConfig)
# -> (the module holding them, each table's blocks to fill), or None for one QuantEmbeddingBagCollection.
# Inference sharding at export passes one, so the rows are quantized straight into their shards.
Layout = Callable[[List[EmbeddingBagConfig], Dict[str, DataType], bool, QuantConfig], Optional[Tuple[nn.Module, Dict[str, List[BlockView]]]]]


def quantize_embedding_bag_collection(
    ebc: EmbeddingBagCollection, config: Optional[QuantConfig] = None,
    weights: Optional[TableLoader] = None, on_table: Optional[TableHook] = None,
) -> Tuple[QuantEmbeddingBagCollection, QuantizationReport]:
    """A QuantEmbeddingBagCollection holding ``ebc``'s tables in the configured types, and its report.

    ``weights``: loads a table's float weight by name, one table in memory at a time (the
    module's own parameters may then be on ``meta``); ``on_table(config, weight)`` sees each
    float table while it is loaded.
    """
    module, report = _quantize_bags(ebc, config or QuantConfig(), weights, on_table, None)
    assert isinstance(module, QuantEmbeddingBagCollection)  # no layout: one module of the tables
    return module, report


def _quantize_bags(ebc: EmbeddingBagCollection, config: QuantConfig, weights: Optional[TableLoader],
                   on_table: Optional[TableHook], layout: Optional[Layout]) -> Tuple[nn.Module, QuantizationReport]:
    """``quantize_embedding_bag_collection``, the rows placed by ``layout`` when it gives a place."""
    tables = ebc.embedding_bag_configs()
    if layout is not None:
        require_float32_output(config.output_dtype, "inference sharding at export")
    source: Union[_OneAtATime, Dict[str, torch.Tensor]] = (
        _OneAtATime(weights) if weights is not None else {t.name: _table_weight(ebc.embedding_bags, t.name) for t in tables}
    )

    def build(types: Dict[str, DataType]) -> Tuple[nn.Module, Dict[str, List[BlockView]]]:
        placed = None if layout is None else layout(tables, types, ebc.is_weighted(), config)
        if placed is not None:
            return placed
        return _whole(QuantEmbeddingBagCollection(tables, ebc.is_weighted(), config.device, config.output_dtype, weight_types=types,
                                                  row_alignment=config.alignment, id_policy=config.id_policy,
                                                  host_rows=config.host_rows))

    return _quantize(tables, source.__getitem__, build, config, on_table)


def _whole(module: Q) -> Tuple[Q, Dict[str, List[BlockView]]]:
    """``module`` and each of its tables as one block."""
    return module, {name: [BlockView(slice(None), slice(None), data, scale_bias)]
                    for name, (data, scale_bias) in module.table_weights().items()}


class _OneAtATime:
    """A mapping table name -> weight that loads on access and keeps only the last table."""

    def __init__(self, load: TableLoader) -> None:
        self._load = load
        self._name: Optional[str] = None
        self._weight: Optional[torch.Tensor] = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if name != self._name or self._weight is None:
            self._weight = None  # drop the previous table before loading the next
            self._weight, self._name = self._load(name), name
        return self._weight


def _table_weight(tables: nn.ModuleDict, name: str) -> torch.Tensor:
    """The float weight [rows, dim] of a collection's ``name`` table (its nn.EmbeddingBag / nn.Embedding)."""
    weight = tables[name].weight
    assert isinstance(weight, torch.Tensor), f"table {name!r} holds no weight tensor"
    return weight


def quantize_embedding_collection(
    ec: EmbeddingCollection, config: Optional[QuantConfig] = None
) -> Tuple[QuantEmbeddingCollection, QuantizationReport]:
    """A QuantEmbeddingCollection holding ``ec``'s tables in the configured types, and its report."""
    config = config or QuantConfig()
    weights = {t.name: _table_weight(ec.embeddings, t.name) for t in ec.embedding_configs()}
    module, report = _quantize(
        ec.embedding_configs(),
        weights.__getitem__,
        lambda types: _whole(QuantEmbeddingCollection(
            ec.embedding_configs(), config.device, need_indices=ec.need_indices(), output_dtype=config.output_dtype, weight_types=types,
            row_alignment=config.alignment, id_policy=config.id_policy, host_rows=config.host_rows,
        )),
        config,
    )
    assert isinstance(module, QuantEmbeddingCollection)  # built just above
    return module, report


def _quantize(
    tables: Sequence[BaseEmbeddingConfig],
    weight: TableLoader,  # a dict's or _OneAtATime's __getitem__
    build: Callable[[Dict[str, DataType]], Tuple[nn.Module, Dict[str, List[BlockView]]]],
    config: QuantConfig,
    on_table: Optional[TableHook] = None,
) -> Tuple[nn.Module, QuantizationReport]:
    choices = choose_types(tables, weight, config)
    module, views = build({name: c.data_type for name, c in choices.items()})
    reports = []
    for index, t in enumerate(tables):
        reports.append(quantize_into(index, t, weight(t.name), choices[t.name], views[t.name], config))
        if on_table is not None:
            on_table(t, weight(t.name))
    return module, QuantizationReport(reports, config.alignment, config.error_minimizing)


def quantize_embeddings(
    module: nn.Module,
    dtype: Union[str, DataType, None] = None,
    table_dtypes: Optional[Dict[str, Union[str, DataType]]] = None,
    inplace: bool = False,
    weights: Optional[Callable[[str, str], torch.Tensor]] = None,
    on_table: Optional[Callable[[str, BaseEmbeddingConfig, torch.Tensor], None]] = None,
    layout: Optional[Callable[..., Optional[Tuple[nn.Module, Dict[str, List[BlockView]]]]]] = None,
    **options: Any,
) -> Tuple[nn.Module, QuantizationReport]:
    """Swaps every float EmbeddingBagCollection and EmbeddingCollection in ``module``'s tree for its quantized twin.

    Args:
        module: any nn.Module; collections may be nested anywhere (in ModuleLists and
            ModuleDicts too), several, weighted or not. A collection reached by two paths
            (shared between towers) is quantized once and both paths get the same module.
        dtype: every table's type (a DataType, its name, or "auto"); default INT8.
        table_dtypes: table -> type, overriding ``dtype``. A key is a table name, or
            "<collection path>.<table>" where two collections have a table of that name.
        inplace: swap inside ``module`` itself; otherwise a deep copy is quantized.
        weights: ``weights(collection path, table)`` loads an EmbeddingBagCollection table's
            float weight (e.g. from a checkpoint), one table in memory at a time: the
            collections' own parameters may then be on ``meta``.
        on_table: ``on_table(collection path, table config, weight)`` sees each
            EmbeddingBagCollection table while its float weight is loaded.
        layout: ``layout(collection path, *Layout's arguments)`` places an EmbeddingBagCollection's
            rows (export's inference shards); None, or its None: one QuantEmbeddingBagCollection.
        options: the other QuantConfig fields (error_budget, error_minimizing, device,
            chunk_rows, id_policy, ...); id_policy's features may belong to any collection.

    Returns (the quantized module, one report whose tables are named "<path>.<table>").
    """
    if not inplace:
        module = copy.deepcopy(module)
    # exactly these two types, as before (``type(m) is`` also narrows m for mypy)
    found: List[Tuple[str, FloatCollection]] = [
        (path, m) for path, m in module.named_modules(remove_duplicate=False)
        if type(m) is EmbeddingBagCollection or type(m) is EmbeddingCollection
    ]
    if not found:
        raise ValueError(f"{type(module).__name__} holds no EmbeddingBagCollection or EmbeddingCollection to quantize")
    collections: Dict[int, Tuple[str, FloatCollection]] = {}
    for path, m in found:
        collections.setdefault(id(m), (path, m))
    tables = {key: _configs(m) for key, (_, m) in collections.items()}
    id_policy: Dict[str, str] = options.pop("id_policy", None) or {}
    config = QuantConfig(dtype=dtype, table_dtypes=dict(table_dtypes or {}), **options)
    assigned = _assign(config.table_dtypes, "table_dtypes", {k: [t.name for t in ts] for k, ts in tables.items()}, collections)
    policies = _assign(id_policy, "id_policy", {k: [f for t in ts for f in t.feature_names] for k, ts in tables.items()}, collections)
    reports: List[TableReport] = []
    swapped: Dict[int, nn.Module] = {}
    for key, (path, m) in collections.items():
        # per_table_weight_dtype is already in config.table_dtypes, and split among the collections
        sub = dataclasses.replace(config, table_dtypes=assigned[key], per_table_weight_dtype=None, id_policy=policies[key])
        if isinstance(m, EmbeddingBagCollection):
            load = None if weights is None else (lambda name, path=path: weights(path, name))
            hook = None if on_table is None else (lambda t, w, path=path: on_table(path, t, w))
            swapped[key], report = _quantize_bags(m, sub, load, hook, None if layout is None else functools.partial(layout, path))
        else:
            swapped[key], report = quantize_embedding_collection(m, sub)
        reports += [dataclasses.replace(r, table=f"{path}.{r.table}" if path else r.table) for r in report.tables]
    for path, m in found:
        if not path:
            module = swapped[id(m)]
            continue
        module.set_submodule(path, swapped[id(m)])
    return module, QuantizationReport(reports, config.alignment, config.error_minimizing)


# TorchRec's attributes, set on a float collection before from_float, that choose its quantized state_dict's layout
# (recship.quantize.embedding_modules sets them under TorchRec's function names)
SPLIT_SCALE_BIAS_ATTR = "__quant_state_dict_split_scale_bias"
REGISTER_TBES_ATTR = "__register_tbes_in_named_modules"
ROW_ALIGNMENT_ATTR = "__register_row_alignment_in_named_modules"
# TorchRec's set_pruning_data: table -> rows kept (the first ones) after pruning
PRUNING_ATTR = "__emb_name_to_num_rows_post_pruning"


@overload
def quantize_from_float(cls: Type[QuantEmbeddingBagCollection], module: nn.Module) -> QuantEmbeddingBagCollection: ...


@overload
def quantize_from_float(cls: Type[QuantEmbeddingCollection], module: nn.Module) -> QuantEmbeddingCollection: ...


def quantize_from_float(cls: Type[QuantModule], module: nn.Module) -> QuantModule:
    """``cls.from_float(module)``: ``module``'s tables quantized as its ``qconfig`` says.

    With torch's quantize_dynamic one qconfig serves every collection of the model, so
    ``per_table_weight_dtype`` may name tables of other collections; those entries are
    skipped here (an unknown name in ``table_dtypes`` is still an error).
    """
    pooled = issubclass(cls, QuantEmbeddingBagCollection)
    float_type = EmbeddingBagCollection if pooled else EmbeddingCollection
    if not isinstance(module, float_type):
        raise TypeError(f"{cls.__name__}.from_float takes a float {float_type.__name__}, got {type(module).__name__}")
    qconfig = getattr(module, "qconfig", None)
    if isinstance(qconfig, QConfig):
        qconfig = QuantConfig(activation=qconfig.activation, weight=qconfig.weight)
    if not isinstance(qconfig, QuantConfig):
        raise TypeError(
            f"{type(module).__name__}.qconfig must be a recship.QuantConfig (e.g. quantize_dynamic(model, "
            f"qconfig_spec={{{type(module).__name__}: QuantConfig(activation=..., weight=...)}})), got {type(qconfig).__name__}"
        )
    devices = {p.device for p in module.parameters()}
    if len(devices) != 1:
        raise ValueError(f"{type(module).__name__}.from_float needs its tables on one device, found {sorted(map(str, devices))}")
    device = next(iter(devices))
    names = {t.name for t in _configs(module)}
    shared = set(qconfig.per_table_weight_dtype or {})
    alignment = getattr(module, ROW_ALIGNMENT_ATTR, TORCHREC_ROW_ALIGNMENT)
    config = dataclasses.replace(
        qconfig,
        device="cpu" if device.type == "meta" else str(device),
        row_alignment=alignment if qconfig.row_alignment is None else qconfig.row_alignment,
        table_dtypes={t: v for t, v in qconfig.table_dtypes.items() if t in names or t not in shared},
        per_table_weight_dtype=None,
    )
    module = _pruned(module, getattr(module, PRUNING_ATTR, None) or {})
    if device.type == "meta":
        twin = _empty_twin(module, config)
        if isinstance(twin, QuantEmbeddingBagCollection):
            return _state_dict_layout(twin, module)
        return _state_dict_layout(twin, module)
    if isinstance(module, EmbeddingBagCollection):  # exactly when pooled (checked above)
        return _state_dict_layout(quantize_embedding_bag_collection(module, config)[0], module)
    return _state_dict_layout(quantize_embedding_collection(module, config)[0], module)


def _pruned(module: FloatCollection, rows: Dict[str, int]) -> FloatCollection:
    """``module``, or (TorchRec's ``set_pruning_data``) a float twin whose tables keep their first ``rows[table]`` rows
    (views of ``module``'s weights): the quantized tables have that many rows; ids are remapped before the lookup."""
    tables = list(_configs(module))
    # set_pruning_data gives every collection one dict: the entries for other collections' tables are not this one's
    rows = {t.name: rows[t.name] for t in tables if t.name in rows}
    if not rows:
        return module
    bad = {t.name: rows[t.name] for t in tables if t.name in rows and not 0 < rows[t.name] <= t.num_embeddings}
    if bad:
        raise ValueError(f"pruning data for {type(module).__name__}: row counts {bad} not in [1, the table's rows]")
    kept = [dataclasses.replace(t, num_embeddings=rows.get(t.name, t.num_embeddings)) for t in tables]
    twin: FloatCollection
    if isinstance(module, EmbeddingBagCollection):
        twin = EmbeddingBagCollection(cast(List[EmbeddingBagConfig], kept), is_weighted=module.is_weighted(), device="meta")
        container = "embedding_bags"
    else:
        twin = EmbeddingCollection(cast(List[EmbeddingConfig], kept), device="meta")
        container = "embeddings"
    weights = {f"{container}.{t.name}.weight": _table_weight(getattr(module, container), t.name)[: t.num_embeddings] for t in kept}
    twin.load_state_dict(weights, assign=True)
    for attr in (SPLIT_SCALE_BIAS_ATTR, REGISTER_TBES_ATTR):
        if hasattr(module, attr):
            setattr(twin, attr, getattr(module, attr))
    return twin


def _empty_twin(module: FloatCollection, config: QuantConfig) -> Union[QuantEmbeddingBagCollection, QuantEmbeddingCollection]:
    """The quantized twin of a collection on ``meta`` (TorchRec's ``DLRMPredictFactory`` builds one to load a
    checkpoint into): its tables in the configured types, rows zero, on the CPU; TorchRec keeps them on meta."""
    tables = list(_configs(module))
    types: Dict[str, DataType] = {}
    for t in tables:
        chosen = config.table_dtypes.get(t.name, config.dtype)
        if not isinstance(chosen, DataType):
            raise ValueError(f"table {t.name!r} is on meta: its type cannot be chosen from its weights ({chosen!r})")
        types[t.name] = chosen
    if isinstance(module, EmbeddingBagCollection):
        return QuantEmbeddingBagCollection(module.embedding_bag_configs(), module.is_weighted(), "cpu", config.output_dtype, weight_types=types,
                                           row_alignment=config.alignment, id_policy=config.id_policy)
    return QuantEmbeddingCollection(module.embedding_configs(), "cpu", need_indices=module.need_indices(), output_dtype=config.output_dtype,
                                    weight_types=types,
                                    row_alignment=config.alignment, id_policy=config.id_policy)


def _state_dict_layout(quantized: Q, module: nn.Module) -> Q:
    """``quantized`` with the state_dict layout TorchRec's ``quant_prep_*`` asked of the float ``module``."""
    split, register = (bool(getattr(module, attr, False)) for attr in (SPLIT_SCALE_BIAS_ATTR, REGISTER_TBES_ATTR))
    if split or register:
        quantized.set_state_dict_layout(split_scale_bias=split, register_tbes=register)
    return quantized


def _configs(m: FloatCollection) -> Sequence[BaseEmbeddingConfig]:
    return m.embedding_bag_configs() if isinstance(m, EmbeddingBagCollection) else m.embedding_configs()


V = TypeVar("V")


def _assign(
    given: Mapping[str, V], what: str, names: Mapping[int, List[str]], collections: Mapping[int, Tuple[str, nn.Module]]
) -> Dict[int, Dict[str, V]]:
    """Splits ``given`` (name or "<path>.<name>" -> value) among the collections that own the names."""
    out: Dict[int, Dict[str, V]] = {key: {} for key in collections}
    for name, value in given.items():
        owners = [key for key in collections if name in names[key]]
        qualified = [key for key in collections if collections[key][0] and name.startswith(collections[key][0] + ".")
                     and name[len(collections[key][0]) + 1:] in names[key]]
        if len(owners) > 1:
            paths = [f"{collections[k][0]}.{name}" for k in owners]
            raise ValueError(f"{what}: {name!r} is in several collections; name one of {paths}")
        if owners:
            out[owners[0]][name] = value
        elif qualified:
            key = qualified[0]
            out[key][name[len(collections[key][0]) + 1:]] = value
        else:
            known = sorted(f"{collections[k][0]}.{n}" if collections[k][0] else n for k in collections for n in names[k])
            raise ValueError(f"{what} names {name!r}, which no collection has; known: {known[:20]}")
    return out
