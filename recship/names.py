"""recship's vocabulary, in one place and without torch: the enums of weight types, pooling, sharding,
compute kernels and embedding optimizers, the names flags and config files take, the rules for model
and version names, and the artifact formats.

Command lines, config checks, export and serving import these names from here, so ``--help`` stays
torch-free and no list is written twice. Conversions that need torch or fbgemm import them when called.
"""

import functools
from enum import Enum, unique
from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:
    import torch


@unique
class PoolingType(Enum):
    """How an EmbeddingBag combines the rows of one example's ids."""

    SUM = "SUM"
    MEAN = "MEAN"
    NONE = "NONE"


@unique
class DataType(Enum):
    """Storage type of an embedding table's weights.

    FP32/FP16/BF16 are float storage (trainable); FP8/INT8/INT4/INT2 are the
    row-wise quantized formats of fbgemm's inference kernels. INT64, INT32, UINT8
    and NFP8 are TorchRec's names for other tensors' dtypes (ids, raw bytes,
    fp8 e4m3): they convert (``data_type_to_dtype``) but no recship table stores
    them (``is_table_type``).
    """

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    INT64 = "INT64"
    INT32 = "INT32"
    INT8 = "INT8"
    UINT8 = "UINT8"
    INT4 = "INT4"
    INT2 = "INT2"
    NFP8 = "NFP8"
    FP8 = "FP8"

    @property
    def bits(self) -> int:
        """Bits per stored element (before row-wise scale/bias)."""
        return _BITS[self.value]

    @property
    def is_table_type(self) -> bool:
        """True for the types an embedding table can be stored in (float or fbgemm row-wise quantized)."""
        return self in _TABLE_TYPES

    @property
    def is_float(self) -> bool:
        """True for the types a float (trainable) table can hold."""
        return self in (DataType.FP32, DataType.FP16, DataType.BF16)

    def to_torch_dtype(self) -> "torch.dtype":
        """The torch dtype of a float table; ValueError for quantized types."""
        dtype = _torch_dtypes().get(self)
        if dtype is None:
            raise ValueError(
                f"{self.name} is a quantized type with no float torch dtype; "
                "quantize the table with recship.quantize"
            )
        return dtype

    def to_sparse_type(self):  # -> fbgemm_gpu.split_embedding_configs.SparseType
        """fbgemm's SparseType for this type (imports fbgemm_gpu on first use); ValueError for the types fbgemm has
        no embedding storage for (INT64, INT32, UINT8)."""
        # lazy: keeps --help, which reads these names, free of torch and fbgemm
        from fbgemm_gpu.split_embedding_configs import SparseType

        if self in (DataType.INT64, DataType.INT32, DataType.UINT8):
            raise ValueError(f"DataType {self.name} names no fbgemm embedding storage type")

        return SparseType(self.value.lower())

    @staticmethod
    def from_torch_dtype(dtype: "torch.dtype") -> "DataType":
        for data_type, torch_dtype in _torch_dtypes().items():
            if torch_dtype == dtype:
                return data_type
        raise ValueError(f"no DataType for torch dtype {dtype}")

    @staticmethod
    def from_quant_dtype(dtype: "torch.dtype") -> "DataType":
        """The type a quantization observer's dtype asks for (TorchRec's ``QuantConfig(weight=...)``).

        torch.int8 / qint8 / quint8 -> INT8, quint4x2 -> INT4, quint2x4 -> INT2, and the
        float dtypes as ``from_torch_dtype``; anything else is a ValueError naming it.
        """
        # lazy: keeps --help, which reads these names, free of torch and fbgemm
        import torch

        observers = {torch.int8: DataType.INT8, torch.qint8: DataType.INT8, torch.quint8: DataType.INT8,
                     torch.quint4x2: DataType.INT4, torch.quint2x4: DataType.INT2}
        if dtype in observers:
            return observers[dtype]
        try:
            return DataType.from_torch_dtype(dtype)
        except ValueError:
            valid = ", ".join(str(d) for d in (*observers, *_torch_dtypes().values()))
            raise ValueError(f"no embedding weight type for observer dtype {dtype}; expected one of {valid}") from None

    @staticmethod
    def parse(name: str) -> "DataType":
        """'int8' / 'INT8' -> DataType.INT8, with the valid names in the error."""
        try:
            return DataType[name.upper()]
        except KeyError:
            valid = ", ".join(d.name.lower() for d in DataType)
            raise ValueError(f"unknown data type {name!r}; expected one of {valid}") from None


_BITS = {"FP32": 32, "FP16": 16, "BF16": 16, "INT64": 64, "INT32": 32, "INT8": 8, "UINT8": 8, "INT4": 4, "INT2": 2,
         "NFP8": 8, "FP8": 8}
_TABLE_TYPES = (DataType.FP32, DataType.FP16, DataType.BF16, DataType.FP8, DataType.INT8, DataType.INT4, DataType.INT2)


@functools.lru_cache(maxsize=None)
def _torch_dtypes() -> "dict[DataType, torch.dtype]":
    # lazy: keeps --help, which reads these names, free of torch and fbgemm
    import torch

    return {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}


# TorchRec's module-level conversions (torchrec.modules.embedding_configs), as functions of the enums above.
def data_type_to_dtype(data_type: DataType) -> "torch.dtype":
    """The torch dtype of ``data_type``, as TorchRec's: FP32/FP16/BF16 their float dtypes, INT64/INT32/INT8/UINT8
    the integer dtypes, INT4 torch.quint4x2, INT2 torch.quint2x4, NFP8 torch.float8_e4m3fn. FP8 (fbgemm's row-wise
    HFP8, which TorchRec has not) is a ValueError."""
    # lazy: keeps --help, which reads these names, free of torch and fbgemm
    import torch

    if not isinstance(data_type, DataType):
        raise TypeError(f"data_type_to_dtype takes a DataType, got {data_type!r}")
    if data_type is DataType.FP8:
        raise ValueError("DataType FP8 (fbgemm's row-wise 8-bit float) cannot be converted to a torch dtype")
    if data_type.is_float:
        return data_type.to_torch_dtype()
    return _other_dtypes()[data_type]


@functools.lru_cache(maxsize=None)
def _other_dtypes() -> "dict[DataType, torch.dtype]":
    # lazy: keeps --help, which reads these names, free of torch and fbgemm
    import torch

    return {DataType.INT64: torch.int64, DataType.INT32: torch.int32, DataType.INT8: torch.int8,
            DataType.UINT8: torch.uint8, DataType.INT4: torch.quint4x2, DataType.INT2: torch.quint2x4,
            DataType.NFP8: torch.float8_e4m3fn}


def dtype_to_data_type(dtype: "torch.dtype") -> DataType:
    """The DataType of a torch dtype, as TorchRec's: float32/float16/bfloat16, int64, int32, int8/qint8/quint8 -> INT8,
    uint8, quint4x2 -> INT4, quint2x4 -> INT2, float8_e4m3fn -> NFP8; ValueError for any other dtype."""
    # lazy: keeps --help, which reads these names, free of torch and fbgemm
    import torch

    others = {torch.int64: DataType.INT64, torch.int32: DataType.INT32, torch.uint8: DataType.UINT8,
              torch.float8_e4m3fn: DataType.NFP8}
    if dtype in others:
        return others[dtype]
    try:
        return DataType.from_quant_dtype(dtype)
    except ValueError:
        raise ValueError(f"Invalid data type {dtype}: no DataType for it") from None


def data_type_to_sparse_type(data_type: DataType):  # -> fbgemm_gpu.split_embedding_configs.SparseType
    """fbgemm's SparseType of ``data_type`` (imports fbgemm_gpu), as TorchRec's: UINT8 is INT8; INT64 and INT32,
    which name no embedding storage, are a ValueError."""
    if not isinstance(data_type, DataType):
        raise ValueError(f"Invalid DataType {data_type!r}")
    if data_type is DataType.UINT8:
        data_type = DataType.INT8
    return data_type.to_sparse_type()


def pooling_type_to_str(pooling_type: PoolingType) -> str:
    """"sum" or "mean"; ValueError for NONE (an unpooled table has no bag mode)."""
    if pooling_type in (PoolingType.SUM, PoolingType.MEAN):
        return pooling_type.value.lower()
    raise ValueError(f"Unsupported pooling type {pooling_type}: only SUM and MEAN name a bag mode")


def pooling_type_to_pooling_mode(pooling_type: PoolingType, sharding_type: Optional["ShardingType"] = None):
    """fbgemm's PoolingMode of ``pooling_type`` (imports fbgemm_gpu). MEAN under row-wise or table-row-wise
    sharding is SUM, as TorchRec's: those shardings divide by the bag size after their all-to-all."""
    # lazy: keeps --help, which reads these names, free of torch and fbgemm
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import PoolingMode

    if not isinstance(pooling_type, PoolingType):
        raise ValueError(f"Invalid pooling type {pooling_type!r}")
    if pooling_type is PoolingType.MEAN and sharding_type is not None and sharding_type.value in ("row_wise", "table_row_wise"):
        return PoolingMode.SUM
    return PoolingMode[pooling_type.value]


@unique
class ShardingType(str, Enum):
    """How one table is split across ranks. A str, as TorchRec's ``ParameterSharding.sharding_type`` is: it equals its
    value (``p.sharding_type == ShardingType.TABLE_WISE.value`` and ``== "table_wise"`` hold)."""

    DATA_PARALLEL = "data_parallel"  # a full replica on every rank, gradients all-reduced
    TABLE_WISE = "table_wise"  # the whole table on one rank
    ROW_WISE = "row_wise"  # contiguous row blocks, one per rank of the world
    COLUMN_WISE = "column_wise"  # column blocks (multiples of 4 wide), each on one rank
    TABLE_ROW_WISE = "table_row_wise"  # row blocks over the local ranks of one host
    # TorchRec's other two, named so that TorchRec code reads; recship does not shard this way (see ``check_runnable``)
    TABLE_COLUMN_WISE = "table_column_wise"  # TorchRec: column blocks over the ranks of one host
    GRID_SHARD = "grid_shard"  # TorchRec: column blocks, each row-wise over the ranks of one host

    def check_runnable(self) -> "ShardingType":
        """``self`` if recship shards tables this way, else a ValueError naming it (TorchRec has it, recship not)."""
        if self not in TRAINING_SHARDING_TYPES:
            raise ValueError(f"sharding type {self.value!r} is TorchRec's; recship shards tables "
                             f"{[st.value for st in TRAINING_SHARDING_TYPES]} only")
        return self


# what recship's sharded modules and planner run (TorchRec's TABLE_COLUMN_WISE and GRID_SHARD are not among them)
TRAINING_SHARDING_TYPES = (ShardingType.DATA_PARALLEL, ShardingType.TABLE_WISE, ShardingType.ROW_WISE,
                           ShardingType.COLUMN_WISE, ShardingType.TABLE_ROW_WISE)


@unique
class EmbeddingComputeKernel(str, Enum):
    """How a shard is looked up and updated; a str equal to its value, as ``ShardingType``.

    recship trains with DENSE (data-parallel replicas) and FUSED (every sharded type); QUANT names quantized
    inference shards (``recship.distributed._shard_modules``). TorchRec's other kernels are named so that
    TorchRec code reads, and asking for one is a ValueError (``check_runnable``): UVM and its caching, SSD/DRAM
    virtual tables and key-value stores are CUDA/SSD offloading, Triton and customized kernels GPU code.
    """

    DENSE = "dense"  # plain torch tables, dense-gradient optimizer (data-parallel)
    FUSED = "fused"  # fbgemm TBE with the optimizer fused into backward
    FUSED_UVM = "fused_uvm"
    FUSED_UVM_CACHING = "fused_uvm_caching"
    QUANT = "quant"
    QUANT_UVM = "quant_uvm"
    QUANT_UVM_CACHING = "quant_uvm_caching"
    KEY_VALUE = "key_value"
    CUSTOMIZED_KERNEL = "customized_kernel"
    SSD_VIRTUAL_TABLE = "ssd_virtual_table"
    DRAM_VIRTUAL_TABLE = "dram_virtual_table"
    DRAM_SSD_VIRTUAL_TABLE = "dram_ssd_virtual_table"
    FUSED_TRITON = "fused_triton"

    def check_runnable(self) -> "EmbeddingComputeKernel":
        """``self`` if recship runs it (dense, fused; quant for inference shards), else a ValueError naming it."""
        if self not in (EmbeddingComputeKernel.DENSE, EmbeddingComputeKernel.FUSED, EmbeddingComputeKernel.QUANT):
            raise ValueError(f"compute kernel {self.value!r} is TorchRec's (UVM, caching, SSD/key-value offload, "
                             "Triton: CUDA kernels); recship trains with 'dense' (data_parallel) and 'fused' (every "
                             "other sharding type) only, and shards quantized tables with 'quant'")
        return self


@unique
class EmbOptimType(Enum):
    """The fused embedding optimizers (fbgemm's update rules)."""

    EXACT_SGD = "exact_sgd"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_rowwise_adagrad"
    ADAM = "adam"
    PARTIAL_ROWWISE_ADAM = "partial_rowwise_adam"
    LAMB = "lamb"

    @classmethod
    def _missing_(cls, value: object) -> Optional["EmbOptimType"]:
        """``EmbOptimType("EXACT_SGD")`` is ``EmbOptimType("exact_sgd")``: the name works as well as the value."""
        if isinstance(value, str):
            return cls._value2member_map_.get(value.lower())  # type: ignore[return-value]
        return None

    @property
    def cpu_supported(self) -> bool:
        """fbgemm has CPU kernels for it (the others need CUDA)."""
        return self in (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD)

    def state_floats(self, rows: int, cols: int) -> int:
        """fp32 optimizer-state elements for a [rows, cols] shard."""
        if self is EmbOptimType.EXACT_SGD:
            return 0
        if self is EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            return rows  # one running mean of g^2 per row
        if self is EmbOptimType.EXACT_ADAGRAD:
            return rows * cols
        if self is EmbOptimType.PARTIAL_ROWWISE_ADAM:
            return rows * cols + rows  # full first moment, row-wise second moment
        return 2 * rows * cols  # ADAM, LAMB: two full moments


def _values(members) -> Tuple[str, ...]:
    return tuple(m.value for m in members)


# the names flags and config files take
OPTIMIZERS = _values(EmbOptimType)
CPU_OPTIMIZERS = _values(o for o in EmbOptimType if o.cpu_supported)
SHARDINGS = _values(TRAINING_SHARDING_TYPES)  # training
INFERENCE_SHARDINGS = _values((ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE))  # export
INFERENCE_TYPES = (DataType.INT8, DataType.INT4, DataType.INT2, DataType.FP8, DataType.FP16, DataType.FP32)  # what export writes
AUTO = "auto"  # a table's type chosen per table by the error budget
EXPORT_DTYPES = tuple(t.name.lower() for t in INFERENCE_TYPES) + (AUTO,)  # --dtype, --table-dtype
DEVICES = ("cpu", "cuda")
DEVICE_CHOICES = ("auto",) + DEVICES  # --device of train, export and serve: auto is cuda where torch sees a GPU, else cpu
LOG_FORMATS = ("text", "json")
EXPORT_FORMATS = ("auto", "torchscript", "aoti", "both")  # what export writes: model.pt, model.pt2 or both
LOAD_FORMATS = ("auto", "torchscript", "aoti")  # what a loader runs (auto: model.pt2 where it runs here)
ID_POLICIES = ("reject", "modulo")  # an id outside its table: refused, or hashed into it

DLRM_ENTRY = "recship.models.dlrm:builtin"  # the built-in DLRM: what `recship train` trains without --model
# the built-in DLRM's entry point before it became TorchRec's DLRM (other parameter names): its checkpoints are refused
EARLIER_DLRM_ENTRY = "recship.models:dlrm"

# Criteo's layout (the built-in DLRM and data reader): 13 integer (dense) features, 26 categorical (sparse) ones
CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26

# A model's name (a repository folder, a served model) and a version's: the repository layout's (recship.contract)
from recship.contract.repository import MODEL_NAME, VERSION_NAME  # noqa: E402
