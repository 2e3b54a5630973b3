"""Jagged sparse data types: JaggedTensor, KeyedJaggedTensor, KeyedTensor."""

from recship.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor"]
