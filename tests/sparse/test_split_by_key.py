"""KeyedJaggedTensor.split_by_key: each key's values and zero-based offsets, as to_dict gives them, cached."""

from typing import List, Tuple

import pytest
import torch

from recship.sparse import KeyedJaggedTensor
from reference import random_kjt


@pytest.mark.parametrize("lengths_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("keys", [["a", "b", "c"], ["a"], ["b", "a", "b"]])
def test_split_by_key_equals_to_dict(lengths_dtype, keys):
    kjt, ref, _ = random_kjt(keys, batch_size=6, seed=len(keys), lengths_dtype=lengths_dtype)
    values, offsets = kjt.split_by_key()
    assert len(values) == len(offsets) == len(keys)
    for i, key in enumerate(keys):
        want = [v for row in ref[key] for v in row] if keys.count(key) == 1 else None
        if want is not None:
            assert values[i].tolist() == want
        lengths = kjt.lengths().view(len(keys), -1)[i]
        assert offsets[i].dtype == lengths_dtype
        assert offsets[i].tolist() == [0] + torch.cumsum(lengths, 0).tolist()
    per_key = kjt.to_dict()  # a repeated key: to_dict keeps the last occurrence
    last = {k: i for i, k in enumerate(keys)}
    for key, jt in per_key.items():
        assert torch.equal(values[last[key]], jt.values())
        assert torch.equal(offsets[last[key]], jt.offsets())


def test_split_by_key_is_cached_until_unsync():
    kjt, _, _ = random_kjt(["a", "b"], batch_size=3, seed=0)
    first = kjt.split_by_key()
    assert kjt.split_by_key() is first
    kjt.unsync()
    again = kjt.split_by_key()
    assert again is not first
    assert all(torch.equal(x, y) for x, y in zip(again[0] + again[1], first[0] + first[1]))


def test_split_by_key_scripts():
    @torch.jit.script
    def split(kjt: KeyedJaggedTensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        return kjt.split_by_key()

    kjt, _, _ = random_kjt(["a", "b"], batch_size=4, seed=1)
    got, want = split(kjt), kjt.split_by_key()
    assert all(torch.equal(x, y) for x, y in zip(got[0] + got[1], want[0] + want[1]))
