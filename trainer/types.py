"""The one dtype enum of recship, with its conversions, and the pooling enum.

Every layer (float training tables, quantized inference tables, the export
manifest) names weight types with ``DataType``; conversions to torch dtypes and
to fbgemm's ``SparseType`` live here and nowhere else.
"""

from enum import Enum, unique
from typing import Optional

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
    row-wise quantized formats of fbgemm's inference kernels.
    """

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    FP8 = "FP8"
    INT8 = "INT8"
    INT4 = "INT4"
    INT2 = "INT2"

    @property
    def bits(self) -> int:
        """Bits per stored element (before row-wise scale/bias)."""
        return _BITS[self]

    @property
    def is_float(self) -> bool:
        """True for the types a float (trainable) table can hold."""
        return self in (DataType.FP32, DataType.FP16, DataType.BF16)

    def to_torch_dtype(self) -> torch.dtype:
        """The torch dtype of a float table; ValueError for quantized types."""
        dtype = _TORCH.get(self)
        if dtype is None:
            raise ValueError(
                f"{self.name} is a quantized type with no float torch dtype; "
                "quantize the table with recship.quantize"
            )
        return dtype

    def to_sparse_type(self):  # -> fbgemm_gpu.split_embedding_configs.SparseType
        """fbgemm's SparseType for this type (imports fbgemm_gpu on first use)."""
        from fbgemm_gpu.split_embedding_configs import SparseType

        return SparseType(self.value.lower())

    @staticmethod
    def from_torch_dtype(dtype: torch.dtype) -> "DataType":
        for data_type, torch_dtype in _TORCH.items():
            if torch_dtype == dtype:
                return data_type
        raise ValueError(f"no DataType for torch dtype {dtype}")

    @staticmethod
    def from_quant_dtype(dtype: torch.dtype) -> "DataType":
        """The type a quantization observer's dtype asks for (TorchRec's ``QuantConfig(weight=...)``).

        torch.int8 / qint8 / quint8 -> INT8, quint4x2 -> INT4, quint2x4 -> INT2, and the
        float dtypes as ``from_torch_dtype``; anything else is a ValueError naming it.
        """
        quantized = _QUANT_TORCH.get(dtype)
        if quantized is not None:
            return quantized
        try:
            return DataType.from_torch_dtype(dtype)
        except ValueError:
            valid = ", ".join(str(d) for d in (*_QUANT_TORCH, *(d for d in _TORCH.values() if d is not None)))
            raise ValueError(f"no embedding weight type for observer dtype {dtype}; expected one of {valid}") from None

    @staticmethod
    def parse(name: str) -> "DataType":
        """'int8' / 'INT8' -> DataType.INT8, with the valid names in the error."""
        try:
            return DataType[name.upper()]
        except KeyError:
            valid = ", ".join(d.name.lower() for d in DataType)
            raise ValueError(f"unknown data type {name!r}; expected one of {valid}") from None


_BITS = {
    DataType.FP32: 32,
    DataType.FP16: 16,
    DataType.BF16: 16,
    DataType.FP8: 8,
    DataType.INT8: 8,
    DataType.INT4: 4,
    DataType.INT2: 2,
}

_TORCH: dict[DataType, Optional[torch.dtype]] = {
    DataType.FP32: torch.float32,
    DataType.FP16: torch.float16,
    DataType.BF16: torch.bfloat16,
}

# dtypes of torch's quantization observers, as TorchRec's QuantConfig uses them
_QUANT_TORCH: dict[torch.dtype, DataType] = {
    torch.int8: DataType.INT8,
    torch.qint8: DataType.INT8,
    torch.quint8: DataType.INT8,
    torch.quint4x2: DataType.INT4,
    torch.quint2x4: DataType.INT2,
}
