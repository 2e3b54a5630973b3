"""Pools of tensors and of KeyedJaggedTensor rows addressed by an integer id (TorchRec's object_pool, tensor_pool,
keyed_jagged_tensor_pool and object_pool_lookups): e.g. an entity id's features kept for hard-negative sampling.

``TensorPool``: [pool_size, dim] rows; ``update(ids, values [n, dim])`` writes rows, ``lookup(ids)`` -> [n, dim].
``KeyedJaggedTensorPool``: per id, one example of every feature (at most ``feature_max_lengths[f]`` values each);
``update(ids, kjt)`` stores example b of ``kjt`` under ``ids[b]``, ``lookup(ids)`` -> a KJT of stride len(ids),
keys in ``feature_max_lengths`` order. A repeated id in one update keeps its last example (TorchRec's
``deterministic_dedup``). Storage and state_dict keys are TorchRec's: ``_pool`` [pool_size, dim]; ``values``
[pool_size, sum of max lengths] (an id's features' values one after another, zero padded), ``key_lengths``
[pool_size, F] int32 and, weighted, ``weights`` [pool_size, sum of max lengths] float32.

Where TorchRec differs: without ``device`` the pools are on the CPU (TorchRec's are on meta, for its sharded
versions to materialise: recship has none); bad ids, dtypes and lengths are ValueErrors (TorchRec asserts, and
lets a negative id wrap around); a weighted KeyedJaggedTensorPool looks up (TorchRec 1.8.0's unsharded one fails
reading ``_weights``); its values are int32 or int64 (recship's KeyedJaggedTensor holds integer ids);
``enable_uvm`` is refused: fbgemm's UVM lookups (TorchRec's ``UVMCaching*Lookup``) need CUDA
and are not in recship.
"""

import abc
from typing import Any, Dict, Generic, Iterator, List, Optional, Tuple, TypeVar

import torch
from torch import nn

from recship.models.module_helpers import deterministic_dedup
from recship.sparse import JaggedTensor, KeyedJaggedTensor

T = TypeVar("T")


class ObjectPool(abc.ABC, nn.Module, Generic[T]):
    """A pool of objects of type T addressed by integer ids: ``lookup(ids)``, ``update(ids, values)``, ``pool_size``."""

    @abc.abstractmethod
    def lookup(self, ids: torch.Tensor) -> T:
        pass

    @abc.abstractmethod
    def update(self, ids: torch.Tensor, values: T) -> None:
        pass

    @property
    @abc.abstractmethod
    def pool_size(self) -> int:
        pass


def _check_ids(ids: torch.Tensor, pool_size: int, device: torch.device) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be a 1-D int32/int64 tensor, got {ids!r}")
    if ids.device.type != device.type:
        raise ValueError(f"ids are on {ids.device}, the pool on {device}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= pool_size):
        raise ValueError(f"ids must lie in [0, {pool_size}), got {int(ids.min())}..{int(ids.max())}")


def _refuse_uvm(enable_uvm: bool) -> None:
    if enable_uvm:
        raise ValueError("enable_uvm=True: fbgemm's UVM pools need CUDA and are not in recship; use enable_uvm=False")


def _pool_device(device: Optional[torch.device]) -> torch.device:
    return torch.device(device) if device is not None else torch.device("cpu")


class TensorPool(ObjectPool[torch.Tensor]):
    """[pool_size, dim] rows of ``dtype`` addressed by id.

    Args:
        pool_size: rows.
        dim: each row's width.
        dtype: the rows' dtype.
        device: where the pool lives (CPU by default).
        loaded_values: initial [pool_size, dim] rows (zeros without).
        enable_uvm: refused (see the module docstring).

    forward(ids [n]) = lookup(ids) -> [n, dim].
    """

    def __init__(self, pool_size: int, dim: int, dtype: torch.dtype, device: Optional[torch.device] = None,
                 loaded_values: Optional[torch.Tensor] = None, enable_uvm: bool = False) -> None:
        super().__init__()
        _refuse_uvm(enable_uvm)
        self._pool_size, self._dim, self._dtype = pool_size, dim, dtype
        self._device = _pool_device(device)
        self._enable_uvm = enable_uvm
        self.register_buffer("_pool", torch.zeros((pool_size, dim), dtype=dtype, device=self._device))
        if loaded_values is not None:
            if tuple(loaded_values.shape) != (pool_size, dim) or loaded_values.dtype != dtype:
                raise ValueError(f"loaded_values must be [{pool_size}, {dim}] {dtype}, got "
                                 f"{list(loaded_values.shape)} {loaded_values.dtype}")
            self._pool = loaded_values.to(self._device)

    @property
    def pool_size(self) -> int:
        return self._pool_size

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def pool(self) -> torch.Tensor:
        return self._pool

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> their rows [n, dim]."""
        _check_ids(ids, self._pool_size, self._device)
        return self._pool[ids]

    def update(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Writes values [n, dim] (the pool's dtype and device) at ids [n]; a repeated id keeps its last row."""
        if values.dim() != 2 or values.shape[1] != self._dim or values.dtype != self._dtype:
            raise ValueError(f"values must be [n, {self._dim}] {self._dtype}, got {list(values.shape)} {values.dtype}")
        if values.device.type != self._device.type:
            raise ValueError(f"values are on {values.device}, the pool on {self._device}")
        _check_ids(ids, self._pool_size, self._device)
        if values.shape[0] != ids.shape[0]:
            raise ValueError(f"{ids.shape[0]} ids for {values.shape[0]} rows of values")
        unique, last = deterministic_dedup(ids)
        self._pool[unique] = values[last]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids)


# -- KeyedJaggedTensor rows ------------------------------------------------------------------------------------------


def _row_major(values: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The values of a feature-major jagged [F, B] (``lengths`` [F, B]) regrouped by example: for each b of ``rows``
    in turn, its F features' values one after another."""
    f, b = lengths.shape
    rank = torch.full((b,), -1, dtype=torch.int64, device=lengths.device)
    rank[rows] = torch.arange(rows.numel(), device=lengths.device)
    cell = torch.repeat_interleave(torch.arange(f * b, device=lengths.device), lengths.flatten().long())
    cell_rank = rank[cell % b]
    keep = cell_rank >= 0
    order = torch.argsort(cell_rank[keep] * f + cell[keep] // b, stable=True)
    return values[keep][order]


def _feature_major(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The inverse regrouping: row-major values (``lengths`` [n, F]) -> feature f's values of every row, f by f."""
    n, f = lengths.shape
    cell = torch.repeat_interleave(torch.arange(n * f, device=lengths.device), lengths.flatten().long())
    return values[torch.argsort((cell % f) * n + cell // f, stable=True)]


def _padded(values: torch.Tensor, row_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Row-major jagged values -> [rows, width], each row's values first, zeros after."""
    out = torch.zeros((row_lengths.numel(), width), dtype=values.dtype, device=values.device)
    out[torch.arange(width, device=values.device) < row_lengths.unsqueeze(1)] = values
    return out


def _unpadded(rows: torch.Tensor, row_lengths: torch.Tensor) -> torch.Tensor:
    return rows[torch.arange(rows.shape[1], device=rows.device) < row_lengths.unsqueeze(1)]


class KeyedJaggedTensorPoolLookup(abc.ABC, nn.Module):
    """The storage behind a KeyedJaggedTensorPool: per id, F lengths (``_key_lengths`` [pool_size, F] int32) and
    their values. ``lookup(ids [n])`` -> JaggedTensor of lengths [n * F] (row-major: id by id, feature by feature);
    ``update(ids, JaggedTensor in that layout)`` (distinct ids); ``states_to_register()`` names the tensors a pool
    registers as its buffers."""

    def __init__(self, pool_size: int, feature_max_lengths: Dict[str, int], is_weighted: bool,
                 device: torch.device) -> None:
        super().__init__()
        self._pool_size = pool_size
        self._feature_max_lengths = dict(feature_max_lengths)
        self._is_weighted = is_weighted
        self._device = torch.device(device)
        self._total_lengths = sum(self._feature_max_lengths.values())
        self._key_lengths = torch.zeros((pool_size, len(self._feature_max_lengths)), dtype=torch.int32, device=self._device)

    @abc.abstractmethod
    def lookup(self, ids: torch.Tensor) -> JaggedTensor:
        pass

    @abc.abstractmethod
    def update(self, ids: torch.Tensor, values: JaggedTensor) -> None:
        pass

    @abc.abstractmethod
    def states_to_register(self) -> Iterator[Tuple[str, torch.Tensor]]:
        pass

    def forward(self, ids: torch.Tensor) -> JaggedTensor:
        return self.lookup(ids)


class TensorJaggedIndexSelectLookup(KeyedJaggedTensorPoolLookup):
    """Dense storage: ``_values`` [pool_size, sum of max lengths] of ``values_dtype`` (an id's values first, zero
    padded), ``_weights`` likewise float32 when weighted. ``lookup`` returns values [N, 1], as TorchRec's."""

    def __init__(self, pool_size: int, values_dtype: torch.dtype, feature_max_lengths: Dict[str, int],
                 is_weighted: bool, device: torch.device) -> None:
        super().__init__(pool_size, feature_max_lengths, is_weighted, device)
        self._values_dtype = values_dtype
        self._values = torch.zeros((pool_size, self._total_lengths), dtype=values_dtype, device=self._device)
        self._weights = torch.zeros((pool_size, self._total_lengths) if is_weighted else (0,), dtype=torch.float,
                                    device=self._device)

    def lookup(self, ids: torch.Tensor) -> JaggedTensor:
        """ids [n] -> JaggedTensor(values [N, 1], lengths [n * F] int32, weights [N, 1] if weighted)."""
        key_lengths = self._key_lengths[ids]
        totals = key_lengths.sum(dim=1)
        values = _unpadded(self._values[ids], totals).unsqueeze(-1)
        weights = _unpadded(self._weights[ids], totals).unsqueeze(-1) if self._is_weighted else None
        return JaggedTensor(values=values, weights=weights, lengths=key_lengths.flatten())

    def update(self, ids: torch.Tensor, values: JaggedTensor) -> None:
        """Stores row-major values (lengths [n * F]) at distinct ids [n]."""
        key_lengths = values.lengths().view(-1, len(self._feature_max_lengths))
        totals = key_lengths.sum(dim=1)
        self._values[ids] = _padded(values.values().flatten(), totals, self._total_lengths).to(self._values_dtype)
        self._key_lengths[ids] = key_lengths.to(self._key_lengths.dtype)
        weights = values.weights_or_none()
        if self._is_weighted and weights is not None:
            self._weights[ids] = _padded(weights.flatten().float(), totals, self._total_lengths)

    def states_to_register(self) -> Iterator[Tuple[str, torch.Tensor]]:
        yield "values", self._values
        yield "key_lengths", self._key_lengths
        if self._is_weighted:
            yield "weights", self._weights


class KeyedJaggedTensorPool(ObjectPool[KeyedJaggedTensor]):
    """One example of every feature per id.

    Args:
        pool_size: ids.
        feature_max_lengths: feature -> the most values one example of it may hold (the keys, in this order, are the
            pool's features).
        values_dtype: the values' dtype.
        is_weighted: keep the KJT's weights too.
        device: where the pool lives (CPU by default).
        enable_uvm: refused (see the module docstring).

    Example::

        pool = KeyedJaggedTensorPool(10, {"f1": 2, "f2": 3})
        pool.update(torch.tensor([4, 0]), KeyedJaggedTensor(["f1", "f2"], torch.tensor([1, 2, 3, 4]),
                                                             lengths=torch.tensor([2, 0, 1, 1])))
        pool.lookup(torch.tensor([0]))  # f1: [[]], f2: [[4]]
    """

    def __init__(self, pool_size: int, feature_max_lengths: Dict[str, int], values_dtype: torch.dtype = torch.int64,
                 is_weighted: bool = False, device: Optional[torch.device] = None, enable_uvm: bool = False) -> None:
        super().__init__()
        _refuse_uvm(enable_uvm)
        if not feature_max_lengths or any(int(m) < 0 for m in feature_max_lengths.values()):
            raise ValueError(f"feature_max_lengths must name at least one feature, each with a length >= 0, got "
                             f"{feature_max_lengths}")
        if values_dtype not in (torch.int32, torch.int64):
            raise ValueError(f"values_dtype must be torch.int32 or torch.int64 (recship's KeyedJaggedTensor holds integer "
                             f"ids), got {values_dtype}")
        self._pool_size = pool_size
        self._feature_max_lengths = dict(feature_max_lengths)
        self._keys = list(self._feature_max_lengths)
        self._values_dtype = values_dtype
        self._is_weighted = is_weighted
        self._device = _pool_device(device)
        self._enable_uvm = enable_uvm
        self.register_buffer("_feature_max_lengths_t", torch.tensor(list(self._feature_max_lengths.values()),
                                                                    dtype=torch.int32, device=self._device),
                             persistent=False)
        self._lookup = TensorJaggedIndexSelectLookup(pool_size, values_dtype, self._feature_max_lengths, is_weighted,
                                                     self._device)
        for name, tensor in self._lookup.states_to_register():
            self.register_buffer(name, tensor)

    def _apply(self, fn: Any, recurse: bool = True) -> "KeyedJaggedTensorPool":
        super()._apply(fn, recurse)  # the buffers may be new tensors now: the lookup reads them
        buffers = {name: b for name, b in self._buffers.items() if b is not None}
        self._lookup._values, self._lookup._key_lengths = buffers["values"], buffers["key_lengths"]
        if self._is_weighted:
            self._lookup._weights = buffers["weights"]
        return self

    @property
    def pool_size(self) -> int:
        return self._pool_size

    @property
    def feature_max_lengths(self) -> Dict[str, int]:
        return self._feature_max_lengths

    @property
    def values_dtype(self) -> torch.dtype:
        return self._values_dtype

    @property
    def is_weighted(self) -> bool:
        return self._is_weighted

    def lookup(self, ids: torch.Tensor) -> KeyedJaggedTensor:
        """ids [n] -> KJT of the pool's keys, stride n: example i is id ids[i]'s (lengths int32)."""
        _check_ids(ids, self._pool_size, self._device)
        rows = self._lookup.lookup(ids)
        key_lengths = rows.lengths().view(-1, len(self._keys))
        values = _feature_major(rows.values().flatten(), key_lengths)
        weights = _feature_major(rows.weights().flatten(), key_lengths) if self._is_weighted else None
        return KeyedJaggedTensor(keys=self._keys, values=values, weights=weights, lengths=key_lengths.t().flatten(),
                                 stride=int(ids.numel()))

    def update(self, ids: torch.Tensor, values: KeyedJaggedTensor) -> None:
        """Stores example b of ``values`` (a KJT with at least the pool's keys, stride len(ids), values of the pool's
        dtype) under ids[b]; a repeated id keeps its last example."""
        _check_ids(ids, self._pool_size, self._device)
        missing = [k for k in self._keys if k not in values.keys()]
        if missing:
            raise ValueError(f"the KeyedJaggedTensor lacks the pool's features {missing}; it has {values.keys()}")
        if values.values().dtype != self._values_dtype:
            raise ValueError(f"the pool holds {self._values_dtype} values, the KeyedJaggedTensor has {values.values().dtype}")
        if self._is_weighted and values.weights_or_none() is None:
            raise ValueError("the pool is weighted (is_weighted=True): the KeyedJaggedTensor needs weights")
        if values.stride() != ids.numel():
            raise ValueError(f"{ids.numel()} ids for a KeyedJaggedTensor of {values.stride()} examples")
        kjt = values.permute([values.keys().index(k) for k in self._keys])
        lengths = kjt.lengths().view(len(self._keys), -1)
        longest = lengths.max(dim=1).values if lengths.numel() else torch.zeros(len(self._keys), dtype=lengths.dtype)
        for k, most, allowed in zip(self._keys, longest.tolist(), self._feature_max_lengths.values()):
            if most > allowed:
                raise ValueError(f"feature {k!r} has an example of {most} values; the pool keeps at most {allowed}")
        unique, last = deterministic_dedup(ids)
        row_values = _row_major(kjt.values(), lengths, last)
        row_weights = _row_major(kjt.weights(), lengths, last) if self._is_weighted else None
        self._lookup.update(unique, JaggedTensor(values=row_values, weights=row_weights,
                                                 lengths=lengths[:, last].t().flatten()))

    def forward(self, ids: torch.Tensor) -> KeyedJaggedTensor:
        return self.lookup(ids)


# -- the tensor pool's lookups -------------------------------------------------------------------------------------


class TensorPoolLookup(abc.ABC, nn.Module):
    """The storage behind a sharded TensorPool (TorchRec's interface): ``lookup``, ``update`` (distinct ids),
    ``states_to_register`` and ``set_state(loaded_values)``."""

    def __init__(self, pool_size: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self._pool_size, self._dim, self._dtype, self._device = pool_size, dim, dtype, torch.device(device)

    @abc.abstractmethod
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        pass

    @abc.abstractmethod
    def update(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        pass

    @abc.abstractmethod
    def states_to_register(self) -> Iterator[Tuple[str, torch.Tensor]]:
        pass

    @abc.abstractmethod
    def set_state(self, loaded_values: torch.Tensor) -> None:
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids)


class TensorLookup(TensorPoolLookup):
    """A dense [pool_size, dim] tensor (``_pool``); ``enable_uvm`` is refused (see the module docstring)."""

    def __init__(self, pool_size: int, dim: int, dtype: torch.dtype, device: torch.device, enable_uvm: bool = False) -> None:
        super().__init__(pool_size, dim, dtype, device)
        _refuse_uvm(enable_uvm)
        self._enable_uvm = enable_uvm
        self._pool = torch.zeros((pool_size, dim), dtype=dtype, device=self._device)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> [n, dim]."""
        if ids.device.type != self._device.type:
            raise ValueError(f"ids are on {ids.device}, the lookup on {self._device}")
        return self._pool[ids]

    def update(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        self._pool[ids] = values

    def set_state(self, loaded_values: torch.Tensor) -> None:
        self._pool.copy_(loaded_values)

    def states_to_register(self) -> Iterator[Tuple[str, torch.Tensor]]:
        yield "_pool", self._pool


__all__: List[str] = ["KeyedJaggedTensorPool", "KeyedJaggedTensorPoolLookup", "ObjectPool", "TensorJaggedIndexSelectLookup",
                      "TensorLookup", "TensorPool", "TensorPoolLookup"]
