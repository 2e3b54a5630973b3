"""Checks of the derived values a caller may hand a KeyedJaggedTensor or KeyedTensor (TorchRec's constructor
arguments ``stride_per_key``, ``lengths_offset_per_key``, ``offset_per_key``, ``index_per_key``, ``jt_dict``): each
must equal what the tensor would compute itself, else a ValueError naming it. Eager only (no device
synchronisation: they are compared with host-side facts), so a caller that already has them skips the computation
without risking a tensor that disagrees with itself.
"""

from typing import Any, Dict, List, Optional


def _running(starts_at_zero: List[int]) -> List[int]:
    out = [0]
    for n in starts_at_zero:
        out.append(out[-1] + n)
    return out


def check_kjt_caches(kjt: Any, stride_per_key: Optional[List[int]], lengths_offset_per_key: Optional[List[int]],
                     offset_per_key: Optional[List[int]], index_per_key: Optional[Dict[str, int]],
                     jt_dict: Optional[Dict[str, Any]]) -> None:
    owner = "KeyedJaggedTensor"
    keys: List[str] = kjt.keys()
    if stride_per_key is not None and list(stride_per_key) != kjt.stride_per_key():
        how = ("the row sums of stride_per_key_per_rank" if kjt.variable_stride_per_key()
               else "the stride of every key (give stride_per_key_per_rank for a variable batch)")
        raise ValueError(f"{owner}: stride_per_key {list(stride_per_key)} is not {how}: {kjt.stride_per_key()}")
    if lengths_offset_per_key is not None and list(lengths_offset_per_key) != kjt.lengths_offset_per_key():
        raise ValueError(f"{owner}: lengths_offset_per_key {list(lengths_offset_per_key)} is not "
                         f"{kjt.lengths_offset_per_key()} (the running sum of the keys' batch sizes)")
    if offset_per_key is not None:
        opk = list(offset_per_key)
        if len(opk) != len(keys) + 1 or opk[0] != 0 or opk[-1] != kjt.values().numel() or opk != sorted(opk):
            raise ValueError(f"{owner}: offset_per_key {opk} must be {len(keys) + 1} non-decreasing offsets from 0 to "
                             f"len(values) = {kjt.values().numel()}")
        if kjt._length_per_key is not None and opk != _running(kjt._length_per_key):
            raise ValueError(f"{owner}: offset_per_key {opk} disagrees with length_per_key {kjt._length_per_key}")
    if index_per_key is not None and dict(index_per_key) != kjt.index_per_key():
        raise ValueError(f"{owner}: index_per_key {dict(index_per_key)} is not each key's position {kjt.index_per_key()}")
    if jt_dict is not None and sorted(jt_dict) != sorted(set(keys)):
        raise ValueError(f"{owner}: jt_dict has keys {sorted(jt_dict)}, the tensor {keys}")


def check_kt_caches(keys: List[str], length_per_key: List[int], offset_per_key: Optional[List[int]],
                    index_per_key: Optional[Dict[str, int]]) -> None:
    if offset_per_key is not None and list(offset_per_key) != _running(length_per_key):
        raise ValueError(f"KeyedTensor: offset_per_key {list(offset_per_key)} is not the running sum of length_per_key "
                         f"{_running(length_per_key)}")
    if index_per_key is not None and dict(index_per_key) != {k: i for i, k in enumerate(keys)}:
        raise ValueError(f"KeyedTensor: index_per_key {dict(index_per_key)} is not each key's position in {keys}")
