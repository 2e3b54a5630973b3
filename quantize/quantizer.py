"""Quantize a float EmbeddingBagCollection, table by table, with an error report.

    qebc, report = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="int4", table_dtypes={"small": "fp16"}))
    print(report)                      # per table: type, bytes before/after, row and pooled errors
    report.to_json()                   # what the export manifest carries

``dtype="auto"`` picks, per table, the smallest type whose measured error (on a
sample of the table's rows and on sample pooled lookups) stays within
``error_budget``. Rows are processed ``chunk_rows`` at a time, so tables of any
size quantize with bounded extra memory.

The same steps stream tables held elsewhere (export reads them from a checkpoint
and quantizes them straight into inference shards):

    choices = choose_types(tables, load, config)          # reads only "auto" tables
    ...build storage for {name: c.data_type}, get BlockViews of it...
    for i, t in enumerate(tables):
        report = quantize_into(i, t, load(t.name), choices[t.name], blocks[t.name], config)
"""

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple, Union

import torch

from recship.names import AUTO, INFERENCE_TYPES, DataType
from recship.quantize.rowwise import dequantize_rows, quantize_measured, quantize_measured_into, quantize_rows, row_bytes, row_chunks, single_threaded_pool
from recship.modules.embedding_configs import BaseEmbeddingConfig
from recship.trainer.text import text_table

# auto mode tries these, smallest first (FP8 costs what INT8 costs and is less accurate here)
AUTO_CANDIDATES = (DataType.INT2, DataType.INT4, DataType.INT8, DataType.FP16, DataType.FP32)


def _parse_type(value: Union[str, DataType], what: str) -> Union[str, DataType]:
    """A DataType or its name -> the DataType (checked servable); any case of "auto" -> AUTO."""
    if isinstance(value, DataType):
        return _servable(value, what)
    if isinstance(value, str) and value.lower() == AUTO:
        return AUTO
    return _servable(DataType.parse(value), what)


def _servable(dt: DataType, what: str) -> DataType:
    if dt not in INFERENCE_TYPES:
        valid = ", ".join(d.name.lower() for d in INFERENCE_TYPES)
        raise ValueError(f"{what}: {dt.name} cannot be served by fbgemm's inference kernels; use one of {valid} or auto")
    return dt


# Where quantized tables keep their host rows: ``allocate(nbytes)`` returns a zero-filled uint8 tensor [nbytes], e.g.
# a writable mapping of the tables file an export is writing, so that rows are quantized straight into it.
HostRows = Callable[[int], torch.Tensor]


@dataclass
class QuantConfig:
    """How to quantize.

    Args:
        dtype: the default for every table: a DataType, its name, or "auto" (default INT8); the
            same name as ``recship export --dtype`` and ExportConfig.dtype.
        table_dtypes: table name -> type (or "auto"), overriding the default (``--table-dtype``).
        error_budget: for "auto", the largest acceptable relative error.
        error_minimizing: for INT4/INT2, search clipping ranges per row (never worse
            than min/max on any row).
        device: "cpu" or "cuda" (decides row alignment: 1 on CPU, 16 on CUDA).
        row_alignment: override the device's row alignment.
        chunk_rows: rows quantized at a time.
        id_policy: feature -> "reject" (default) or "modulo".
        sample_batches, sample_batch_size, sample_pooling, seed: the sample lookups
            the pooled error is measured on.
        activation, weight, per_table_weight_dtype: TorchRec's way to say the same
            (``QuantConfig(activation=PlaceholderObserver.with_args(dtype=torch.float),
            weight=PlaceholderObserver.with_args(dtype=torch.int8))``): observer factories
            whose dtypes give the output type (``output_dtype``: float32, float16 or bfloat16;
            export, serving and inference sharding take float32) and ``dtype``, and
            table -> torch dtype entries for ``table_dtypes`` (``DataType.from_quant_dtype``).
            Pass them by keyword; a type they give must agree with one given directly.
        host_rows: where the CPU tables' rows are allocated (``HostRows``); None: fbgemm's own zeros.
    """

    # torch's quantize_dynamic treats a qconfig with ``_fields == ("activation", "weight")``
    # as its own QConfig namedtuple and rebuilds it; anything else is passed through untouched
    _fields: ClassVar[Tuple[str, ...]] = ()  # set below to the field names, as a namedtuple's

    dtype: Union[str, DataType, None] = None
    table_dtypes: Dict[str, Union[str, DataType]] = field(default_factory=dict)
    error_budget: float = 0.01
    error_minimizing: bool = True
    device: str = "cpu"
    row_alignment: Optional[int] = None
    chunk_rows: int = 65536
    id_policy: Dict[str, str] = field(default_factory=dict)
    sample_batches: int = 4
    sample_batch_size: int = 128
    sample_pooling: int = 20
    seed: int = 0
    activation: Optional[Callable[[], Any]] = None
    weight: Optional[Callable[[], Any]] = None
    per_table_weight_dtype: Optional[Dict[str, torch.dtype]] = None
    host_rows: Optional[HostRows] = None

    def __post_init__(self) -> None:
        if callable(self.dtype) and not isinstance(self.dtype, (str, DataType)):
            raise TypeError(
                "QuantConfig's first argument is dtype; pass TorchRec's observers by keyword: "
                "QuantConfig(activation=..., weight=...)"
            )
        parsed = None if self.dtype is None else _parse_type(self.dtype, "dtype")
        if self.weight is not None:
            from_weight = _observed_type(_observer_dtype(self.weight, "weight"), "weight")
            if parsed is not None and parsed != from_weight:
                raise ValueError(f"dtype {_name(parsed)} disagrees with the weight observer's {_name(from_weight)}")
            parsed = from_weight
        self.dtype = DataType.INT8 if parsed is None else parsed
        if self.activation is not None:
            check_output_dtype(_observer_dtype(self.activation, "activation"), "activation dtype")
        self.table_dtypes = {t: _parse_type(v, f"table {t!r}") for t, v in self.table_dtypes.items()}
        for t, dtype in (self.per_table_weight_dtype or {}).items():
            dt = _observed_type(dtype, f"per_table_weight_dtype[{t!r}]")
            if self.table_dtypes.get(t, dt) != dt:
                raise ValueError(f"table {t!r}: table_dtypes says {_name(self.table_dtypes[t])}, per_table_weight_dtype {_name(dt)}")
            self.table_dtypes[t] = dt
        if self.error_budget <= 0:
            raise ValueError(f"error_budget must be > 0, got {self.error_budget}")
        if self.chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {self.chunk_rows}")

    @property
    def output_dtype(self) -> torch.dtype:
        """The quantized collections' output dtype: the activation observer's (TorchRec reads
        ``qconfig.activation().dtype``), float32 without one."""
        return torch.float32 if self.activation is None else _observer_dtype(self.activation, "activation")

    @property
    def alignment(self) -> int:
        if self.row_alignment is not None:
            return self.row_alignment
        return 16 if self.device.startswith("cuda") else 1


# what torch's quantize_dynamic reads to tell a namedtuple QConfig (see the comment above)
QuantConfig._fields = tuple(f.name for f in dataclasses.fields(QuantConfig))


# what fbgemm's inference TBE can answer in (its output_dtype), as TorchRec's quantized collections take it
OUTPUT_DTYPES: Tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def check_output_dtype(dtype: torch.dtype, what: str = "output_dtype") -> torch.dtype:
    """``dtype`` if the quantized collections can output it (float32, float16, bfloat16), else ValueError."""
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"{what} {dtype}: the quantized collections output one of {list(OUTPUT_DTYPES)}")
    return dtype


def require_float32_output(dtype: torch.dtype, what: str) -> None:
    """ValueError unless ``dtype`` is float32: ``what`` (the flat lookup behind export and serving, inference
    sharding) answers float32, so a collection built with another output dtype stays in eager use."""
    if dtype != torch.float32:
        raise ValueError(f"{what} takes quantized collections that output float32; this one outputs {dtype} "
                         "(output_dtype / the qconfig's activation dtype); quantize with torch.float for it")


def _observer_dtype(factory: Any, what: str) -> torch.dtype:
    """The dtype of the observer ``factory()`` builds (e.g. ``PlaceholderObserver.with_args(dtype=...)``)."""
    if not callable(factory):
        raise TypeError(f"{what} must be an observer factory such as PlaceholderObserver.with_args(dtype=...), got {factory!r}")
    dtype = getattr(factory(), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what}: the observer {factory!r} builds has no torch dtype (got {dtype!r})")
    return dtype


def _observed_type(dtype: torch.dtype, what: str) -> DataType:
    """The inference weight type an observer dtype asks for; ValueError naming ``what`` and the dtype."""
    try:
        data_type = DataType.from_quant_dtype(dtype)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    return _servable(data_type, what)


def _name(data_type: Union[str, DataType]) -> str:
    return data_type.name if isinstance(data_type, DataType) else str(data_type)


@dataclass
class TableReport:
    """What quantization did to one table."""

    table: str
    data_type: str
    chosen_by: str  # "default", "per_table" or "auto"
    rows: int
    dim: int
    float_bytes: int
    quantized_bytes: int
    max_abs_error: float
    mean_abs_error: float
    pooled_relative_error: float
    auto_trials: Dict[str, float] = field(default_factory=dict)  # type -> measured error, for auto


@dataclass
class QuantizationReport:
    tables: List[TableReport]
    row_alignment: int
    error_minimizing: bool

    @property
    def float_bytes(self) -> int:
        return sum(t.float_bytes for t in self.tables)

    @property
    def quantized_bytes(self) -> int:
        return sum(t.quantized_bytes for t in self.tables)

    def to_dict(self) -> dict:
        return {
            "row_alignment": self.row_alignment,
            "error_minimizing": self.error_minimizing,
            "float_bytes": self.float_bytes,
            "quantized_bytes": self.quantized_bytes,
            "tables": [asdict(t) for t in self.tables],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)

    def __str__(self) -> str:
        header = ("table", "type", "by", "rows x dim", "bytes before", "bytes after", "max |err|", "mean |err|", "pooled rel err")
        rows = [
            (
                t.table, t.data_type.lower(), t.chosen_by, f"{t.rows} x {t.dim}", f"{t.float_bytes:,}",
                f"{t.quantized_bytes:,}", f"{t.max_abs_error:.3g}", f"{t.mean_abs_error:.3g}", f"{t.pooled_relative_error:.3g}",
            )
            for t in self.tables
        ]
        ratio = self.quantized_bytes / max(1, self.float_bytes)
        total = f"total: {self.float_bytes:,} -> {self.quantized_bytes:,} bytes ({ratio:.3f} of float32)"
        return text_table(header, rows) + "\n" + total


# ---------------------------------------------------------------------------


def _sample_ids(rows: int, config: QuantConfig, index: int) -> torch.Tensor:
    """[batches * batch_size, pooling] sample ids of one table (fixed seed)."""
    g = torch.Generator().manual_seed(config.seed * 1_000_003 + index)
    n = config.sample_batches * config.sample_batch_size
    return torch.randint(0, rows, (n, config.sample_pooling), generator=g)


def _pooled_error(weight: torch.Tensor, ids: torch.Tensor, data_type: DataType, error_minimizing: bool) -> float:
    """||pooled(quantized) - pooled(float)|| / ||pooled(float)|| over the sample lookups."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    rows = weight[unique].detach().float()
    deq = dequantize_rows(quantize_rows(rows, data_type, error_minimizing), data_type, rows.shape[1])
    want = rows[inverse].sum(dim=1)
    got = deq[inverse].sum(dim=1)
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def _row_error(weight: torch.Tensor, data_type: DataType, error_minimizing: bool, sample: torch.Tensor) -> float:
    """||dequantized - float|| / ||float|| over a sample of rows."""
    rows = weight[sample].detach().float()
    deq = dequantize_rows(quantize_rows(rows, data_type, error_minimizing), data_type, rows.shape[1])
    return float((deq - rows).norm() / rows.norm().clamp(min=1e-30))


def _choose_auto(t: BaseEmbeddingConfig, weight: torch.Tensor, config: QuantConfig, index: int) -> Tuple[DataType, Dict[str, float]]:
    ids = _sample_ids(t.num_embeddings, config, index)
    g = torch.Generator().manual_seed(config.seed + index)
    sample = torch.randperm(t.num_embeddings, generator=g)[:4096]
    trials: Dict[str, float] = {}
    for dt in AUTO_CANDIDATES:
        em = config.error_minimizing
        err = max(_pooled_error(weight, ids, dt, em), _row_error(weight, dt, em, sample))
        trials[dt.name] = err
        if err <= config.error_budget:
            return dt, trials
    return DataType.FP32, trials


# -- the streaming API: choose every table's type, then quantize tables one at a time --

TableLoader = Callable[[str], torch.Tensor]  # table name -> its float weight [rows, dim]
TableHook = Callable[[BaseEmbeddingConfig, torch.Tensor], None]


@dataclass
class TypeChoice:
    """The stored type of one table, and why."""

    data_type: DataType
    chosen_by: str  # "default", "per_table" or "auto"
    auto_trials: Dict[str, float] = field(default_factory=dict)  # for auto: type name -> measured error


@dataclass
class BlockView:
    """One block of a float table and the storage it is quantized into.

    ``weight[rows, cols]`` of the float table [num_embeddings, dim] goes into ``data``
    [block rows, row bytes] uint8 and ``scale_bias`` [block rows, 4] uint8 (None for
    FP types): writable views of a TBE's rows (``table_weights()``). An unsharded table is
    one block of ``slice(None)`` rows and columns; inference shards are one block each.
    """

    rows: slice
    cols: slice
    data: torch.Tensor
    scale_bias: Optional[torch.Tensor]


def choose_types(tables: Sequence[BaseEmbeddingConfig], weight: TableLoader, config: QuantConfig) -> Dict[str, TypeChoice]:
    """Every table's stored type: ``config.table_dtypes``, else ``config.dtype``.

    For "auto", the smallest of AUTO_CANDIDATES whose relative error on sample rows and
    sample pooled lookups of the float table stays within ``config.error_budget`` (else
    FP32). ``weight(name)`` returns a table's float weight [rows, dim]; it is called only
    for auto tables, in ``tables`` order, so a streaming reader loads one table at a time.
    The sample of table ``tables[i]`` is seeded by ``config.seed`` and ``i``.

    Raises ValueError when ``config.table_dtypes`` names a table not in ``tables``.
    """
    unknown = sorted(set(config.table_dtypes) - {t.name for t in tables})
    if unknown:
        raise ValueError(f"table_dtypes names tables the module does not have: {unknown}")
    choices: Dict[str, TypeChoice] = {}
    for index, t in enumerate(tables):
        choice = config.table_dtypes.get(t.name, config.dtype)
        if choice == AUTO:
            data_type, trials = _choose_auto(t, weight(t.name), config, index)
            choices[t.name] = TypeChoice(data_type, "auto", trials)
        elif isinstance(choice, DataType):
            choices[t.name] = TypeChoice(choice, "per_table" if t.name in config.table_dtypes else "default")
        else:  # QuantConfig parses every type when built; this one was set on it afterwards
            raise TypeError(f"table {t.name!r}: type {choice!r} is neither a DataType nor {AUTO!r}")
    return choices


def quantize_into(
    index: int, table: BaseEmbeddingConfig, weight: torch.Tensor, choice: TypeChoice, blocks: List[BlockView], config: QuantConfig
) -> TableReport:
    """Quantizes one float table into its storage blocks and reports what that cost.

    Args:
        index: the table's position in ``choose_types``' list (seeds its sample lookups).
        table: its config; ``weight`` its float values [num_embeddings, dim] (any device).
        choice: its type (``choose_types``).
        blocks: the views that together hold the table (see BlockView).
        config: its ``chunk_rows`` rows are quantized at a time (bounded extra memory);
            ``error_minimizing`` picks the clipping, ``alignment`` the reported bytes.

    Returns the table's TableReport: bytes, max and mean |error| over all blocks, and the
    relative error of sample pooled lookups.
    """
    dt = choice.data_type
    values = table.num_embeddings * table.embedding_dim
    max_err, mean_err = 0.0, 0.0
    with torch.no_grad():
        for b in blocks:
            try:
                block_max, block_sum = _fill(weight[b.rows, b.cols], dt, b.data, b.scale_bias, config)
            except NonFiniteRow as e:
                row = (b.rows.start or 0) + e.row
                found = weight[row].detach().float().cpu()
                bad = found[~torch.isfinite(found)]
                why = "fp16 holds at most 65504" if dt == DataType.FP16 else "their scale and bias are fp16"
                shown = f"holds {float(bad[0])}" if bad.numel() else (
                    f"spans [{float(found.min()):.6g}, {float(found.max()):.6g}], beyond what {dt.name} rows hold ({why})")
                raise ValueError(f"table {table.name!r}: row {row} {shown}; a table that cannot be stored finite is not "
                                 "quantized (did the training run diverge, or is the checkpoint corrupt?)") from None
            max_err = max(max_err, block_max)
            mean_err += block_sum / values
    ids = _sample_ids(table.num_embeddings, config, index)
    return TableReport(
        table=table.name,
        data_type=dt.name,
        chosen_by=choice.chosen_by,
        rows=table.num_embeddings,
        dim=table.embedding_dim,
        float_bytes=values * 4,
        quantized_bytes=table.num_embeddings * row_bytes(dt, table.embedding_dim, config.alignment),
        max_abs_error=max_err,
        mean_abs_error=mean_err,
        pooled_relative_error=_pooled_error(weight, ids, dt, config.error_minimizing),
        auto_trials=choice.auto_trials,
    )


class NonFiniteRow(ValueError):
    """Row ``row`` of a block cannot be stored finite (a NaN or inf value, or a span the type cannot hold)."""

    def __init__(self, row: int, data_type: DataType) -> None:
        super().__init__(f"row {row} cannot be stored as {data_type.name}")
        self.row = row


def _first_unstorable(rows: torch.Tensor, data_type: DataType) -> int:
    """The first of ``rows`` whose quantized values are not finite (those of a chunk whose error is not)."""
    for i in range(rows.shape[0]):
        _, worst, _ = quantize_measured(rows[i: i + 1], data_type)
        if not math.isfinite(worst):
            return i
    return 0  # (not reached: some row's error is not finite)


# Rows one worker quantizes at a time: [rows, dim] float temporaries of 2 MB at dim 64 stay in cache.
_BLOCK_ROWS = 8192


def _fill(
    weight: torch.Tensor, dt: DataType, data: torch.Tensor, scale_bias: Optional[torch.Tensor], config: QuantConfig
) -> Tuple[float, float]:
    """Quantizes ``weight`` [rows, cols] into TBE row views; returns (max, sum) of |error|.

    Blocks of at most ``_BLOCK_ROWS`` rows (their temporaries stay in cache) go to one
    single-threaded worker per core: each quantizes its block, writes it into the views and
    measures its error, so every row is read from memory about once.
    """
    if scale_bias is None and dt in (DataType.INT8, DataType.INT4, DataType.INT2):
        raise ValueError(f"{dt.name} rows have scale/bias, but the block has no scale_bias storage")
    def block(rows_range: Tuple[int, int]) -> Tuple[float, float]:
        start, end = rows_range
        rows = weight[start:end].detach().float().cpu()
        worst, total = quantize_measured_into(rows, dt, config.error_minimizing, data[start:end],
                                              None if scale_bias is None else scale_bias[start:end])
        if not math.isfinite(worst):  # a NaN/inf value, or values the type cannot hold: never stored
            raise NonFiniteRow(start + _first_unstorable(rows, dt), dt)
        return worst, total

    blocks = list(row_chunks(weight.shape[0], min(config.chunk_rows, _BLOCK_ROWS)))
    workers = min(torch.get_num_threads(), len(blocks))
    if workers <= 1:
        errors = [block(b) for b in blocks]
    else:
        with single_threaded_pool(workers) as pool:
            errors = list(pool.map(block, blocks))
    return max((e[0] for e in errors), default=0.0), sum(e[1] for e in errors)
