from typing import List

import pytest
import torch

from recship.sparse import KeyedTensor


def _kt(seed: int, keys, dims, batch=4):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(batch, d, generator=g) for d in dims]
    return KeyedTensor.from_tensor_list(keys, parts), parts


def test_to_dict_getitem_and_offsets():
    kt, parts = _kt(0, ["a", "b", "c"], [4, 8, 2])
    assert kt.values().shape == (4, 14)
    assert kt.length_per_key() == [4, 8, 2]
    assert kt.offset_per_key() == [0, 4, 12, 14]
    for key, part in zip(["a", "b", "c"], parts):
        assert torch.equal(kt[key], part)
        assert torch.equal(kt.to_dict()[key], part)
    with pytest.raises(ValueError, match="no key 'z'"):
        kt["z"]


def test_regroup_matches_cat():
    kt1, p1 = _kt(1, ["a", "b"], [4, 8])
    kt2, p2 = _kt(2, ["c"], [2])
    groups = [["c", "a"], ["b"], ["a", "b", "c"]]
    out = KeyedTensor.regroup([kt1, kt2], groups)
    by_name = {"a": p1[0], "b": p1[1], "c": p2[0]}
    for got, group in zip(out, groups):
        assert torch.equal(got, torch.cat([by_name[k] for k in group], dim=1))
    with pytest.raises(ValueError, match="no KeyedTensor has key 'q'"):
        KeyedTensor.regroup([kt1], [["q"]])


def test_inconsistent_keyed_tensor_raises():
    with pytest.raises(ValueError, match="sum\\(length_per_key\\) = 5"):
        KeyedTensor(keys=["a", "b"], length_per_key=[2, 3], values=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="2 keys but 1"):
        KeyedTensor(keys=["a", "b"], length_per_key=[4], values=torch.zeros(2, 4))


def test_scripted_keyed_tensor():
    @torch.jit.script
    def f(x: torch.Tensor, y: torch.Tensor) -> List[torch.Tensor]:
        kt = KeyedTensor.from_tensor_list(["x", "y"], [x, y], 1)
        return [KeyedTensor.regroup([kt], [["y", "x"]])[0], KeyedTensor.regroup_as_dict([kt], [["x"]], ["g"])["g"]]

    x, y = torch.randn(3, 2), torch.randn(3, 5)
    regrouped, as_dict = f(x, y)
    assert torch.equal(regrouped, torch.cat([y, x], dim=1))
    assert torch.equal(as_dict, x)


def test_regroup_as_dict_matches_cat():
    kt1, p1 = _kt(3, ["a", "b"], [3, 5])
    kt2, p2 = _kt(4, ["c"], [2])
    by_name = {"a": p1[0], "b": p1[1], "c": p2[0]}
    groups = [["b"], ["c", "a"]]
    out = KeyedTensor.regroup_as_dict([kt1, kt2], groups, ["first", "second"])
    assert list(out) == ["first", "second"]
    for name, group in zip(["first", "second"], groups):
        assert torch.equal(out[name], torch.cat([by_name[k] for k in group], dim=1))
    with pytest.raises(ValueError, match="2 groups but 1 keys"):
        KeyedTensor.regroup_as_dict([kt1, kt2], groups, ["only"])


def test_device():
    kt, _ = _kt(5, ["a"], [2])
    assert kt.device() == torch.device("cpu")
    assert kt.to(torch.device("cpu")).device() == kt.values().device
