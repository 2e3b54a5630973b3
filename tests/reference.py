"""Test helpers: random KJTs (with an independent plain-Python reference copy) as inputs of the sparse, trainer,
quantize and export modules' tests."""

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import pytest
import torch

from recship.sparse import KeyedJaggedTensor

if TYPE_CHECKING:
    from recship.trainer import EmbeddingBagConfig

# Reference form of a KJT: {key: [[ids of example 0], [ids of example 1], ...]}
Ref = Dict[str, List[List[int]]]


def random_kjt(
    keys: List[str],
    batch_size: int,
    seed: int,
    max_len: int = 4,
    max_id: Union[int, Sequence[int]] = 100,
    weighted: bool = False,
    lengths_dtype: torch.dtype = torch.int64,
    values_dtype: torch.dtype = torch.int64,
    min_len: int = 0,
) -> Tuple[KeyedJaggedTensor, Ref, Optional[Dict[str, List[List[float]]]]]:
    """A random KJT plus the same data as nested Python lists (built independently).

    Drawn key by key, in ``keys`` order: lengths [batch_size] in [min_len, max_len], then the ids, each in
    [0, max_id) (``max_id``: one bound, or one per key), then with ``weighted`` a weight per id in [0, 1).
    A repeated key gets ids of its own at each occurrence; the lists hold its last, as
    ``KeyedJaggedTensor.to_dict`` reads it.
    """
    bounds = [max_id] * len(keys) if isinstance(max_id, int) else list(max_id)
    if len(bounds) != len(keys):
        raise ValueError(f"random_kjt: {len(bounds)} bounds in max_id for {len(keys)} keys")
    g = torch.Generator().manual_seed(seed)
    lengths, values, weights = [], [], []
    ref: Ref = {}
    wref: Dict[str, List[List[float]]] = {}
    for key, bound in zip(keys, bounds):
        n = torch.randint(min_len, max_len + 1, (batch_size,), generator=g)
        ids = torch.randint(0, bound, (int(n.sum()),), generator=g)
        lengths.append(n)
        values.append(ids)
        ref[key] = [row.tolist() for row in ids.split(n.tolist())]
        if weighted:
            w = torch.rand(ids.numel(), generator=g)
            weights.append(w)
            wref[key] = [row.tolist() for row in w.split(n.tolist())]
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values).to(values_dtype),
        lengths=torch.cat(lengths).to(lengths_dtype),
        weights=torch.cat(weights) if weighted else None,
    )
    return kjt, ref, (wref if weighted else None)


def tables_kjt(tables: Sequence["EmbeddingBagConfig"], batch_size: int, seed: int, **kwargs: Any) -> KeyedJaggedTensor:
    """A ``random_kjt`` of every feature of ``tables`` in table order, each feature's ids inside its table
    (``kwargs``: random_kjt's lengths, weights and dtypes)."""
    keys = [f for t in tables for f in t.feature_names]
    rows = [t.num_embeddings for t in tables for _ in t.feature_names]
    return random_kjt(keys, batch_size, seed, max_id=rows, **kwargs)[0]


def kjt_as_lists(kjt: KeyedJaggedTensor) -> Ref:
    """Reads a KJT back into reference form using only lengths and values."""
    lengths = kjt.lengths().tolist()
    values = kjt.values().tolist()
    out: Ref = {}
    pos = 0
    b = kjt.stride()
    for i, k in enumerate(kjt.keys()):
        rows = []
        for n in lengths[i * b : (i + 1) * b]:
            rows.append(values[pos : pos + n])
            pos += n
        out[k] = rows
    assert pos == len(values)
    return out


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class InferenceModule(torch.nn.Module):
    """The TorchRec tutorial's wrapper: a plain module holding a collection as ``ebc_``."""

    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc_ = ebc

    def forward(self, kjt: KeyedJaggedTensor):
        return self.ebc_(kjt)
