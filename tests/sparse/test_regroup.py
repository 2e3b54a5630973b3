"""KeyedTensor regrouping (recship.sparse.regroup, TorchRec's ``torchrec.modules.regroup``): KTRegroupAsDict,
permute_multi_embedding and regroup_kts against plain slicing with seeded inputs, eager, fx-traced and scripted."""

import pytest
import torch

from recship.sparse import (DataType, KeyedTensor, KTRegroupAsDict, PermuteMultiEmbedding, permute_multi_embedding,
                            regroup_kts)

GROUPS = [["g2", "f1"], ["f2", "g1", "f1"], ["f3"]]
NAMES = ["u", "v", "w"]


def _kts(seed, batch=5):
    g = torch.Generator().manual_seed(seed)
    return [KeyedTensor(["f1", "f2", "f3"], [4, 8, 3], torch.randn(batch, 15, generator=g)),
            KeyedTensor(["g1", "g2"], [2, 6], torch.randn(batch, 8, generator=g))]


def _reference(kts, groups, dim=1):
    """Each group's keys' slices, cut by hand from the values and concatenated."""
    slices = {}
    for kt in kts:
        start = 0
        for key, width in zip(kt.keys(), kt.length_per_key()):
            slices[key] = kt.values().narrow(dim, start, width)
            start += width
    return [torch.cat([slices[k] for k in group], dim) for group in groups]


def _assert_dict(got, kts, groups=GROUPS, names=NAMES, dim=1):
    assert list(got) == names
    for name, expected in zip(names, _reference(kts, groups, dim)):
        assert torch.equal(got[name], expected)


def test_regroup_as_dict_takes_each_groups_columns_and_keeps_its_permutation():
    module = KTRegroupAsDict(GROUPS, NAMES)
    for seed in range(3):  # the permutation from the first batch serves the next ones
        kts = _kts(seed)
        _assert_dict(module(kts), kts)
    assert module._is_inited and module._use_fbgemm_regroup
    assert dict(module.state_dict()) == {}  # the permutation is in non-persistent buffers


def test_functions_agree_with_the_reference():
    kts = _kts(4)
    for got, expected in zip(permute_multi_embedding(kts, GROUPS), _reference(kts, GROUPS)):
        assert torch.equal(got, expected)
    once = [["g2", "f1"], ["f2", "g1"], ["f3"]]
    for got, expected in zip(regroup_kts(kts, once), _reference(kts, once)):
        assert torch.equal(got, expected)


def test_keys_along_dim_0_regroup_by_slicing():
    g = torch.Generator().manual_seed(5)
    kts = [KeyedTensor(["x", "y"], [3, 2], torch.randn(5, 4, generator=g), key_dim=0),
           KeyedTensor(["z"], [4], torch.randn(4, 4, generator=g), key_dim=0)]
    module = KTRegroupAsDict([["z", "x"], ["y"]], ["p", "q"])
    _assert_dict(module(kts), kts, [["z", "x"], ["y"]], ["p", "q"], dim=0)
    assert not module._use_fbgemm_regroup


def test_emb_dtype_casts_the_results():
    kts = _kts(6)
    got = KTRegroupAsDict(GROUPS, NAMES, emb_dtype=DataType.FP16)(kts)
    for name, expected in zip(NAMES, _reference(kts, GROUPS)):
        assert got[name].dtype == torch.float16 and torch.equal(got[name], expected.half())


def test_clear_cache_takes_the_next_batchs_widths():
    module = KTRegroupAsDict([["a", "b"]], ["ab"])
    first = [KeyedTensor(["a", "b"], [2, 3], torch.randn(2, 5))]
    _assert_dict(module(first), first, [["a", "b"]], ["ab"])
    wider = [KeyedTensor(["a", "b"], [4, 1], torch.randn(2, 5))]
    module.clear_cache()
    _assert_dict(module(wider), wider, [["a", "b"]], ["ab"])


def test_fx_traced_and_scripted_after_the_first_batch():
    module = KTRegroupAsDict(GROUPS, NAMES)
    module(_kts(0))
    traced = torch.fx.symbolic_trace(module)
    scripted = torch.jit.script(module)
    for seed in (1, 2):
        kts = _kts(seed)
        _assert_dict(traced(kts), kts)
        _assert_dict(scripted(kts), kts)


def test_bad_groups_and_inputs_are_refused():
    with pytest.raises(ValueError, match="2 groups but 1 keys"):
        KTRegroupAsDict([["a"], ["b"]], ["x"])
    with pytest.raises(TypeError, match="emb_dtype must be a DataType"):
        KTRegroupAsDict([["a"]], ["x"], emb_dtype=torch.float16)
    with pytest.raises(ValueError, match="no KeyedTensor has key 'nope'"):
        KTRegroupAsDict([["f1", "nope"]], ["x"])(_kts(0))
    twice = [KeyedTensor(["a"], [2], torch.randn(2, 2)), KeyedTensor(["a"], [2], torch.randn(2, 2))]
    with pytest.raises(ValueError, match="key 'a' is in KeyedTensors 0 and 1"):
        KTRegroupAsDict([["a"]], ["x"])(twice)
    with pytest.raises(ValueError, match="no KeyedTensor given"):
        KTRegroupAsDict([["a"]], ["x"])([])


def test_permute_module_before_init_returns_its_input():
    values = [torch.randn(2, 3)]
    assert PermuteMultiEmbedding([["a"]])(values) is values
