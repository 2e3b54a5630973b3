"""Regrouping KeyedTensors (TorchRec's ``torchrec.modules.regroup`` and the regroup functions of
``torchrec.sparse.jagged_tensor``): the columns of several KeyedTensors (pooled embeddings, keyed along dim 1)
gathered into one tensor per group of keys.

    kts = [KeyedTensor(["f1", "f2"], [4, 8], [B, 12]), KeyedTensor(["f3"], [2], [B, 2])]
    KTRegroupAsDict(groups=[["f1", "f3"], ["f2"]], keys=["user", "item"])(kts)
        -> {"user": [B, 4 + 2], "item": [B, 8]}

``KTRegroupAsDict`` works out the permutation from its first batch and keeps it (``clear_cache`` forgets it); for
keys along dim 1 it runs fbgemm's ``permute_multi_embedding`` (one kernel for every group), otherwise a
concatenation of the keys' slices. A key may appear in several groups. The values are copies: the results equal
the input's slices bit for bit. The module traces with torch.fx (after its first batch) and compiles with TorchScript.
"""

from abc import abstractmethod
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from recship.names import DataType, data_type_to_dtype
from recship.sparse.jagged_tensor import KeyedTensor


class CacheMixin:
    """A module that caches work derived from its inputs (TorchRec's ``torchrec.types.CacheMixin``):
    ``clear_cache()`` makes it derive it again from the next batch."""

    @abstractmethod
    def clear_cache(self) -> None: ...


def is_fx_tracing() -> bool:
    """True while torch.fx symbolically traces (a module then skips work that needs real tensors)."""
    return torch.fx._symbolic_trace.is_fx_symbolic_tracing()


@torch.fx.wrap
def _desugar(kts: List[KeyedTensor]) -> Tuple[List[List[str]], List[List[int]], List[torch.Tensor]]:
    """(keys, length_per_key, values) of each KeyedTensor."""
    return [kt.keys() for kt in kts], [kt.length_per_key() for kt in kts], [kt.values() for kt in kts]


def _check_groups(kts: List[KeyedTensor], groups: List[List[str]], what: str) -> None:
    seen: Dict[str, int] = {}
    for i, kt in enumerate(kts):
        for key in kt.keys():
            if key in seen:
                raise ValueError(f"{what}: key {key!r} is in KeyedTensors {seen[key]} and {i}")
            seen[key] = i
    for group in groups:
        for key in group:
            if key not in seen:
                raise ValueError(f"{what}: no KeyedTensor has key {key!r}; their keys are {list(seen)}")


@torch.fx.wrap
def permute_multi_embedding(keyed_tensors: List[KeyedTensor], groups: List[List[str]]) -> List[torch.Tensor]:
    """One tensor per group, the group's keys' columns side by side: fbgemm's ``permute_multi_embedding`` over
    KeyedTensors keyed along dim 1 ([B, sum of their widths] each). A key may be in several groups.
    -> [B, sum of the group's widths] per group."""
    if not torch.jit.is_scripting():
        _check_groups(keyed_tensors, groups, "permute_multi_embedding")
    keys, lengths, values = _desugar(keyed_tensors)
    permutes, in_shapes, out_shapes, out_lengths = torch.ops.fbgemm.kt_regroup_arguments(values[0], keys, lengths, groups)
    return torch.ops.fbgemm.permute_multi_embedding(values, permutes, in_shapes, out_shapes, out_lengths)


@torch.fx.wrap
def regroup_kts(keyed_tensors: List[KeyedTensor], groups: List[List[str]]) -> List[torch.Tensor]:
    """As ``permute_multi_embedding``, through fbgemm's ``regroup_keyed_tensor`` (TorchRec's name for the
    differentiable form): [B, sum of the group's widths] per group."""
    if not torch.jit.is_scripting():
        _check_groups(keyed_tensors, groups, "regroup_kts")
    keys, lengths, values = _desugar(keyed_tensors)
    return torch.ops.fbgemm.regroup_keyed_tensor(values, keys, lengths, groups)


class PermuteMultiEmbedding(nn.Module):
    """fbgemm's ``permute_multi_embedding`` with its arguments kept as non-persistent buffers (so ``.to(device)``
    moves them and the state_dict has none), set by ``init_tensors``. Before that, forward returns its input.

    Args:
        groups: the keys of each output group (kept for reference).
        multi_device: move the buffers to the input's device on every call.
    """

    def __init__(self, groups: List[List[str]], multi_device: bool = False) -> None:
        super().__init__()
        self._groups = groups
        self.register_buffer("_permutes", torch.empty(0), persistent=False)
        self.register_buffer("_in_shapes", torch.empty(0), persistent=False)
        self.register_buffer("_out_shapes", torch.empty(0), persistent=False)
        self._out_lengths: Optional[List[int]] = None
        self._multi_device = multi_device

    def init_tensors(self, permute: torch.Tensor, in_shapes: torch.Tensor, out_shapes: torch.Tensor,
                     out_lengths: List[int]) -> None:
        """The op's arguments, as fbgemm's ``kt_regroup_arguments`` returns them: permute [P, 6] int32 (input,
        output, input start, output start, length, jump), in_shapes [T] int32, out_shapes [G] int32, out_lengths."""
        self._permutes = permute
        self._in_shapes = in_shapes
        self._out_shapes = out_shapes
        self._out_lengths = out_lengths

    @torch.jit.export
    def set_device(self, device: str) -> None:
        self._permutes = self._permutes.to(device)
        self._in_shapes = self._in_shapes.to(device)
        self._out_shapes = self._out_shapes.to(device)

    def forward(self, values: List[torch.Tensor]) -> List[torch.Tensor]:
        """values: [B, width_t] per input -> [B, out_lengths[g]] per group."""
        permutes, in_shapes, out_shapes = self._permutes, self._in_shapes, self._out_shapes
        if self._multi_device:
            device = values[0].device
            permutes = permutes.to(device, non_blocking=True)
            in_shapes = in_shapes.to(device, non_blocking=True)
            out_shapes = out_shapes.to(device, non_blocking=True)
        out_lengths = self._out_lengths
        if out_lengths is None:
            return values
        return torch.ops.fbgemm.permute_multi_embedding(values, permutes, in_shapes, out_shapes, out_lengths)


@torch.fx.wrap
def _kt_values(kts: List[KeyedTensor]) -> List[torch.Tensor]:
    return [kt.values() for kt in kts]


@torch.fx.wrap
def _gathered(kts: List[KeyedTensor], pairs: List[Tuple[int, str]], dim: int) -> torch.Tensor:
    """The named keys' slices (``(input index, key)`` pairs) concatenated along ``dim``."""
    parts = [kt.to_dict() for kt in kts]
    return torch.cat([parts[i][key] for i, key in pairs], dim=dim)


@torch.fx.wrap
def _as_dict(keys: List[str], values: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {key: values[i] for i, key in enumerate(keys)}


class KTRegroupAsDict(nn.Module, CacheMixin):
    """``KeyedTensor.regroup_as_dict`` as a module that works out the permutation once (from its first batch).

    Args:
        groups: the keys of each output group, in order; a key may be in several groups.
        keys: each group's name in the output dict (as many as ``groups``).
        emb_dtype: cast the results to this type (``DataType.FP16``, ...); None keeps the input's.
        multi_device: move the permutation to the input's device on every call.

    forward(keyed_tensors: List[KeyedTensor]) -> {keys[g]: [B, sum of groups[g]'s widths]}. Every batch must have
    the first batch's keys and widths (``clear_cache()`` to change them).
    """

    _splits: List[int]
    _idx_key_pairs: List[Tuple[int, str]]
    _is_inited: bool

    def __init__(self, groups: List[List[str]], keys: List[str], emb_dtype: Optional[DataType] = None,
                 multi_device: bool = False) -> None:
        super().__init__()
        if len(groups) != len(keys):
            raise ValueError(f"KTRegroupAsDict: {len(groups)} groups but {len(keys)} keys ({keys}): give one key per group")
        if emb_dtype is not None and not isinstance(emb_dtype, DataType):
            raise TypeError(f"KTRegroupAsDict: emb_dtype must be a DataType or None, got {emb_dtype!r}")
        self._groups = groups
        self._keys = keys
        self._is_inited = False
        self._dim: int = 1
        self._use_fbgemm_regroup: bool = False
        self._splits = torch.jit.annotate(List[int], [])
        self._idx_key_pairs = torch.jit.annotate(List[Tuple[int, str]], [])
        self._permute_pooled_embs_impl = PermuteMultiEmbedding(groups, multi_device)
        self._emb_dtype = emb_dtype

    def _init_fbgemm_regroup(self, kts: List[KeyedTensor]) -> None:
        self._use_fbgemm_regroup = True
        keys, lengths, values = _desugar(kts)
        self._permute_pooled_embs_impl.init_tensors(
            *torch.ops.fbgemm.kt_regroup_arguments(values[0], keys, lengths, self._groups))

    def _init_regroup(self, kts: List[KeyedTensor]) -> None:
        where: Dict[str, Tuple[int, int]] = {}  # key -> (input, its width)
        for i, kt in enumerate(kts):
            for key, width in zip(kt.keys(), kt.length_per_key()):
                where[key] = (i, width)
        self._idx_key_pairs = [(where[key][0], key) for group in self._groups for key in group]
        self._splits = [sum(where[key][1] for key in group) for group in self._groups]

    def embedding_cast(self, embs: List[torch.Tensor]) -> List[torch.Tensor]:
        """``embs`` cast to ``emb_dtype`` (as they are when it is None)."""
        if self._emb_dtype is None:
            return embs
        dtype = data_type_to_dtype(self._emb_dtype)
        return [emb.to(dtype=dtype) for emb in embs]

    def forward(self, keyed_tensors: List[KeyedTensor]) -> Dict[str, torch.Tensor]:
        """keyed_tensors: the KeyedTensors holding every grouped key -> {key: [B, group width]}."""
        if not torch.jit.is_scripting():
            if not is_fx_tracing():
                if not self._is_inited:
                    module_init(self, keyed_tensors)
        if self._use_fbgemm_regroup:
            values = self.embedding_cast(_kt_values(keyed_tensors))
            return _as_dict(self._keys, self._permute_pooled_embs_impl(values))
        gathered = self.embedding_cast([_gathered(keyed_tensors, self._idx_key_pairs, self._dim)])[0]
        return _as_dict(self._keys, list(torch.split(gathered, self._splits, dim=self._dim)))

    def clear_cache(self) -> None:
        """Forget the permutation: the next batch sets it again."""
        self._is_inited = False


@torch.jit.ignore
@torch.fx.wrap
def module_init(module: KTRegroupAsDict, keyed_tensors: List[KeyedTensor]) -> None:
    """Sets ``module``'s permutation from ``keyed_tensors`` (its first batch); ValueError when they cannot be
    regrouped: none given, on several devices, keyed along different dims, a key twice or a grouped key absent."""
    if len(keyed_tensors) == 0:
        raise ValueError("KTRegroupAsDict: no KeyedTensor given")
    devices = {str(kt.device()) for kt in keyed_tensors}
    if len(devices) > 1:
        raise ValueError(f"KTRegroupAsDict: the KeyedTensors are on several devices {sorted(devices)}")
    dims = {kt.key_dim() for kt in keyed_tensors}
    if len(dims) > 1:
        raise ValueError(f"KTRegroupAsDict: the KeyedTensors are keyed along different dims {sorted(dims)}")
    _check_groups(keyed_tensors, module._groups, "KTRegroupAsDict")
    module._dim = keyed_tensors[0].key_dim()
    if module._dim == 1:
        module._init_fbgemm_regroup(keyed_tensors)
    else:
        module._init_regroup(keyed_tensors)
    module._is_inited = True


__all__ = ["CacheMixin", "DataType", "KTRegroupAsDict", "PermuteMultiEmbedding", "data_type_to_dtype",
           "is_fx_tracing", "module_init", "permute_multi_embedding", "regroup_kts"]
