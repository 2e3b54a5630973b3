"""KeyedJaggedTensor as a pytree node (``torch.utils._pytree``), as TorchRec registers its KJT.

``tree_flatten(kjt)`` gives six leaves, TorchRec's order: values, weights, lengths, offsets (each None where the
KJT does not report it: ``lengths_or_none()`` / ``offsets_or_none()``), the variable batch sizes as an [F, R]
int32 tensor and the inverse indices' [len(names), B] tensor (None where absent). The context is
``(keys, inverse-index names or None)``: TorchRec keeps only the keys and names the inverse indices by them, which
would silently mislabel rows whose names differ from the keys. ``tree_unflatten`` rebuilds the KJT through its
constructor, so the batch is validated again; fewer leaves (an older spec) are padded with None, more are a
ValueError. Registering happens when ``recship.sparse`` is imported.
"""

from typing import Any, Iterable, List, Optional, Tuple

import torch
from torch.fx._pytree import register_pytree_flatten_spec
from torch.utils._pytree import GetAttrKey, KeyEntry, TreeSpec, register_pytree_node

from recship.sparse.jagged_tensor import KeyedJaggedTensor

_FIELDS = ("_values", "_weights", "_lengths", "_offsets", "_stride_per_key_per_rank", "_inverse_indices")

Context = Tuple[List[str], Optional[List[str]]]


def _batch_sizes(kjt: KeyedJaggedTensor) -> Optional[torch.Tensor]:
    """[F, R] int32 stride_per_key_per_rank (TorchRec keeps it so), None without variable batch."""
    if not kjt.variable_stride_per_key():
        return None
    spkpr = kjt.stride_per_key_per_rank()
    if len(spkpr) == 0:
        return torch.empty((0, 0), dtype=torch.int32)
    return torch.tensor(spkpr, dtype=torch.int32)


def _leaves(kjt: KeyedJaggedTensor) -> List[Optional[torch.Tensor]]:
    inverse = kjt.inverse_indices_or_none()
    return [kjt.values(), kjt.weights_or_none(), kjt.lengths_or_none(), kjt.offsets_or_none(), _batch_sizes(kjt),
            None if inverse is None else inverse[1]]


def _context(kjt: KeyedJaggedTensor) -> Context:
    inverse = kjt.inverse_indices_or_none()
    return (kjt.keys(), None if inverse is None else inverse[0])


def kjt_flatten(kjt: KeyedJaggedTensor) -> Tuple[List[Optional[torch.Tensor]], Context]:
    """(the six leaves, (keys, inverse-index names or None))."""
    return _leaves(kjt), _context(kjt)


def kjt_flatten_with_keys(kjt: KeyedJaggedTensor) -> Tuple[List[Tuple[KeyEntry, Optional[torch.Tensor]]], Context]:
    return [(GetAttrKey(name), leaf) for name, leaf in zip(_FIELDS, _leaves(kjt))], _context(kjt)


def kjt_unflatten(leaves: Iterable[Optional[torch.Tensor]], context: Any) -> KeyedJaggedTensor:
    """The KJT of ``kjt_flatten``'s leaves and context (a list, after a JSON round trip of the spec)."""
    given = list(leaves)
    if len(given) > len(_FIELDS):
        raise ValueError(f"KeyedJaggedTensor: {len(given)} pytree leaves, at most {len(_FIELDS)} "
                         "(values, weights, lengths, offsets, stride_per_key_per_rank, inverse indices)")
    given.extend([None] * (len(_FIELDS) - len(given)))
    keys, names = list(context[0]), context[1]
    values, weights, lengths, offsets, spkpr, inverse = given
    if values is None:
        raise ValueError("KeyedJaggedTensor: the values leaf is None")
    return KeyedJaggedTensor(
        keys=keys, values=values, weights=weights, lengths=lengths, offsets=offsets,
        stride_per_key_per_rank=None if spkpr is None else spkpr.tolist(),
        inverse_indices=None if inverse is None else (list(names if names is not None else keys), inverse),
    )


def _kjt_flatten_spec(kjt: KeyedJaggedTensor, spec: TreeSpec) -> List[Optional[torch.Tensor]]:
    return _leaves(kjt)


register_pytree_node(
    KeyedJaggedTensor,
    kjt_flatten,
    kjt_unflatten,
    flatten_with_keys_fn=kjt_flatten_with_keys,
    serialized_type_name="recship.sparse.jagged_tensor.KeyedJaggedTensor",
)
register_pytree_flatten_spec(KeyedJaggedTensor, _kjt_flatten_spec)
