"""Conversions between KeyedJaggedTensors and other forms (TorchRec's helpers of ``torchrec.sparse``):

- ``ComputeKJTToJTDict`` / ``ComputeJTDictToKJT``: ``kjt.to_dict()`` and ``KeyedJaggedTensor.from_jt_dict`` as
  modules (one node each in an fx graph);
- ``flatten_kjt_list`` / ``unflatten_kjt_list``: a list of KJTs as a flat list of tensors (6 per KJT: values,
  weights, lengths, offsets, the variable batch sizes [F, R] and the inverse indices, None where absent) plus each
  KJT's keys, and back;
- ``maybe_td_to_kjt``: a TensorDict of nested jagged tensors (one per key) as a KJT; a KJT as it is;
- ``validate_keyed_jagged_tensor``: a KJT's consistency (ValueError) and, given table configs, whether its ids lie
  in their tables (False, with a warning, when not).
"""

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from recship.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

logger = logging.getLogger(__name__)

_KJT_FIELDS = 6  # values, weights, lengths, offsets, stride_per_key_per_rank, inverse indices


class ComputeKJTToJTDict(nn.Module):
    """forward(KJT) -> {key: JaggedTensor} (``to_dict()``): each key's ids and lengths, views of the KJT's."""

    def forward(self, keyed_jagged_tensor: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        return keyed_jagged_tensor.to_dict()


class ComputeJTDictToKJT(nn.Module):
    """forward({key: JaggedTensor}) -> KJT (``KeyedJaggedTensor.from_jt_dict``): the keys in the dict's order, every
    JaggedTensor of the same batch size."""

    def forward(self, jt_dict: Dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_jt_dict(jt_dict)


def _flatten(kjt: KeyedJaggedTensor) -> Tuple[List[Optional[torch.Tensor]], List[str]]:
    spkpr = kjt.stride_per_key_per_rank() if kjt.variable_stride_per_key() else None
    inverse = kjt.inverse_indices_or_none()
    return ([kjt.values(), kjt.weights_or_none(), kjt.lengths(), kjt.offsets(),
             None if spkpr is None else torch.tensor(spkpr, dtype=torch.int64),
             None if inverse is None else inverse[1]], kjt.keys())


def flatten_kjt_list(kjt_arr: List[KeyedJaggedTensor]) -> Tuple[List[Optional[torch.Tensor]], List[List[str]]]:
    """(6 tensors or None per KJT, in order, [each KJT's keys]); ``unflatten_kjt_list`` undoes it."""
    data: List[Optional[torch.Tensor]] = []
    contexts: List[List[str]] = []
    for kjt in kjt_arr:
        values, keys = _flatten(kjt)
        data.extend(values)
        contexts.append(keys)
    return data, contexts


def unflatten_kjt_list(values: List[Optional[torch.Tensor]], contexts: List[List[str]]) -> List[KeyedJaggedTensor]:
    """The KJTs ``flatten_kjt_list`` flattened: ``values`` 6 per KJT, ``contexts`` their keys (the inverse indices
    name the KJT's keys). ValueError when the counts disagree."""
    if len(values) != _KJT_FIELDS * len(contexts):
        raise ValueError(f"unflatten_kjt_list: {len(values)} tensors for {len(contexts)} KeyedJaggedTensors "
                         f"({_KJT_FIELDS} each)")
    out = []
    for j, keys in enumerate(contexts):
        vals, weights, lengths, offsets, spkpr, inverse = values[j * _KJT_FIELDS:(j + 1) * _KJT_FIELDS]
        if vals is None:
            raise ValueError(f"unflatten_kjt_list: KeyedJaggedTensor {j} has no values")
        out.append(KeyedJaggedTensor(keys=keys, values=vals, weights=weights, lengths=lengths, offsets=offsets,
                                     stride_per_key_per_rank=None if spkpr is None else spkpr.tolist(),
                                     inverse_indices=None if inverse is None else (keys, inverse)))
    return out


def _jagged_parts(nested: Any, key: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(values, lengths) of a torch nested jagged tensor ([B, j] one key's ids)."""
    if not (isinstance(nested, torch.Tensor) and nested.is_nested):
        raise TypeError(f"maybe_td_to_kjt: key {key!r} holds a {type(nested).__name__}, not a nested jagged tensor")
    njt: Any = nested  # a NestedTensor: lengths() / offsets() are its own
    lengths = njt.lengths() if njt.lengths() is not None else torch.diff(njt.offsets())
    return njt.values(), lengths


def maybe_td_to_kjt(features: Any, keys: Optional[List[str]] = None) -> KeyedJaggedTensor:
    """``features`` as a KJT: a KJT as it is; a TensorDict (or any mapping) of torch nested jagged tensors, one per
    key ([B, j] ids), as the KJT of ``keys`` (default: all, in its order). TypeError for anything else."""
    if isinstance(features, KeyedJaggedTensor):
        return features
    if not hasattr(features, "keys") or not hasattr(features, "__getitem__"):
        raise TypeError(f"maybe_td_to_kjt takes a KeyedJaggedTensor or a TensorDict, got {type(features).__name__}")
    keys = list(features.keys()) if keys is None else list(keys)
    parts = [_jagged_parts(features[k], k) for k in keys]
    return KeyedJaggedTensor(keys=keys, values=torch.cat([v for v, _ in parts]), lengths=torch.cat([n for _, n in parts]))


def validate_keyed_jagged_tensor(kjt: KeyedJaggedTensor, configs: Optional[List[Any]] = None) -> bool:
    """Checks ``kjt``'s lengths, offsets, keys and weights against each other (ValueError naming the fault) and, given
    table configs (anything with ``feature_names`` and ``num_embeddings``), whether each configured feature's ids lie
    in [0, its table's rows): True if so, False (and a warning naming the feature) if not."""
    if not isinstance(kjt, KeyedJaggedTensor):
        raise TypeError(f"validate_keyed_jagged_tensor takes a KeyedJaggedTensor, got {type(kjt).__name__}")
    keys = kjt.keys()
    if len(set(keys)) != len(keys):
        raise ValueError(f"the KeyedJaggedTensor's keys repeat: {keys}")
    lengths, offsets = kjt.lengths(), kjt.offsets()
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"the KeyedJaggedTensor has a negative length {int(lengths.min())}")
    if offsets.numel() != lengths.numel() + 1 or int(offsets[0]) != 0 or not torch.equal(offsets.diff(), lengths.to(offsets.dtype)):
        raise ValueError("the KeyedJaggedTensor's offsets are not the running sum of its lengths from 0")
    if int(offsets[-1]) != kjt.values().numel():
        raise ValueError(f"the KeyedJaggedTensor's lengths add up to {int(offsets[-1])}, its values are {kjt.values().numel()}")
    weights = kjt.weights_or_none()
    if weights is not None and weights.shape != kjt.values().shape:
        raise ValueError(f"the KeyedJaggedTensor's weights have shape {list(weights.shape)}, its values "
                         f"{list(kjt.values().shape)}")
    if configs is None:
        return True
    rows = {f: c.num_embeddings for c in configs for f in c.feature_names}
    valid = True
    for key, jt in kjt.to_dict().items():
        if key not in rows or jt.values().numel() == 0:
            continue
        low, high = int(jt.values().min()), int(jt.values().max())
        if low < 0 or high >= rows[key]:
            logger.warning("feature %s has ids %d..%d, outside its table's [0, %d)", key, low, high, rows[key])
            valid = False
    return valid


__all__ = ["ComputeJTDictToKJT", "ComputeKJTToJTDict", "flatten_kjt_list", "maybe_td_to_kjt", "unflatten_kjt_list",
           "validate_keyed_jagged_tensor"]
