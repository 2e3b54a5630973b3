"""The weight-type and pooling enums, re-exported where the TorchRec import map puts them; they are
defined, with their torch and fbgemm conversions, in recship.names (recship's torch-free vocabulary)."""

from recship.names import DataType, PoolingType

__all__ = ["DataType", "PoolingType"]
