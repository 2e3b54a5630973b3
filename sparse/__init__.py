"""Jagged sparse data types: JaggedTensor, KeyedJaggedTensor, KeyedTensor (and TorchRec's equality helpers)."""

from recship.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor, jt_is_equal, kjt_is_equal

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "jt_is_equal", "kjt_is_equal"]
