"""Test helpers: random KJTs with an independent plain-Python reference copy."""

from typing import Dict, List, Optional, Tuple

import pytest
import torch

from recship.sparse import KeyedJaggedTensor

# Reference form of a KJT: {key: [[ids of example 0], [ids of example 1], ...]}
Ref = Dict[str, List[List[int]]]


def random_kjt(
    keys: List[str],
    batch_size: int,
    seed: int,
    max_len: int = 4,
    max_id: int = 100,
    weighted: bool = False,
    lengths_dtype: torch.dtype = torch.int64,
    values_dtype: torch.dtype = torch.int64,
) -> Tuple[KeyedJaggedTensor, Ref, Optional[Dict[str, List[List[float]]]]]:
    """A random KJT plus the same data as nested Python lists (built independently)."""
    g = torch.Generator().manual_seed(seed)
    ref: Ref = {}
    wref: Dict[str, List[List[float]]] = {}
    for k in keys:
        rows, wrows = [], []
        for _ in range(batch_size):
            n = int(torch.randint(0, max_len + 1, (1,), generator=g))
            rows.append(torch.randint(0, max_id, (n,), generator=g).tolist())
            wrows.append(torch.rand(n, generator=g).tolist())
        ref[k] = rows
        wref[k] = wrows
    lengths = [len(r) for k in keys for r in ref[k]]
    values = [v for k in keys for r in ref[k] for v in r]
    weights = [w for k in keys for r in wref[k] for w in r]
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(values, dtype=values_dtype),
        lengths=torch.tensor(lengths, dtype=lengths_dtype),
        weights=torch.tensor(weights, dtype=torch.float32) if weighted else None,
    )
    return kjt, ref, (wref if weighted else None)


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
