"""TorchRec's container behaviour that recship follows: values of any dtype and [N, D] values (float sequence
features), empty JaggedTensors, traced ``from_dense_lengths``, meta tensors, variable-batch ``from_jt_dict`` and
TorchRec's text. References are plain Python lists split by hand."""

from typing import List

import pytest
import torch
import torch.fx

from recship.sparse import JaggedTensor, KeyedJaggedTensor
from recship.sparse.ids import check_id_dtype, first_out_of_range


def _split(values: List, lengths: List[int]) -> List[List]:
    out, start = [], 0
    for n in lengths:
        out.append(values[start : start + n])
        start += n
    return out


def _float_kjt(seed: int, keys: List[str], batch: int, dim: int = 0):
    """A KJT of float values ([N] or [N, dim]), and per key its rows as lists."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=g, dtype=torch.int32)
    n = int(lengths.sum())
    values = torch.rand((n, dim) if dim else (n,), generator=g)
    kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
    rows = _split(values.tolist(), lengths.tolist())
    return kjt, {k: rows[i * batch : (i + 1) * batch] for i, k in enumerate(keys)}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dim", [0, 3])
def test_float_values_split_permute_and_concat_as_lists(seed, dim):
    keys = ["a", "b", "c"]
    kjt, ref = _float_kjt(seed, keys, batch=4, dim=dim)
    assert {k: _split(jt.values().tolist(), jt.lengths().tolist()) for k, jt in kjt.to_dict().items()} == ref
    assert _split(kjt["b"].values().tolist(), kjt["b"].lengths().tolist()) == ref["b"]
    permuted = kjt.permute([2, 0, 2])
    assert permuted.keys() == ["c", "a", "c"]
    got = _split(permuted.values().tolist(), permuted.lengths().tolist())
    assert got == ref["c"] + ref["a"] + ref["c"]
    left, right = kjt.split([1, 2])
    assert _split(right.values().tolist(), right.lengths().tolist()) == ref["b"] + ref["c"]
    joined = KeyedJaggedTensor.concat([right, left])
    assert _split(joined.values().tolist(), joined.lengths().tolist()) == ref["b"] + ref["c"] + ref["a"]
    assert joined.values().dtype == torch.float32


def test_float_values_keep_the_structural_checks():
    """Any dtype of values, but lengths stay integers and must add up to the values, weights one per value."""
    with pytest.raises(ValueError, match="sum\\(lengths\\) = 3"):
        KeyedJaggedTensor(keys=["a"], values=torch.rand(2), lengths=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="lengths must be an integer tensor"):
        KeyedJaggedTensor(keys=["a"], values=torch.rand(2), lengths=torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="one weight per value"):
        KeyedJaggedTensor(keys=["a"], values=torch.rand(2), lengths=torch.tensor([2]), weights=torch.ones(3))
    # integer weights are a container's business too (TorchRec's)
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.arange(2), lengths=torch.tensor([2]), weights=torch.tensor([3, 4]))
    assert kjt["a"].weights().tolist() == [3, 4]


def test_ids_must_be_integers_to_be_looked_up():
    """The id rule refuses float ids: 2.7 must never become row 2."""
    with pytest.raises(ValueError, match="integer tensor"):
        check_id_dtype(torch.tensor([2.7]), "x")
    with pytest.raises(ValueError, match="integer tensor"):
        first_out_of_range(torch.tensor([0.0, 2.7]), 5)
    with pytest.raises(ValueError, match="1-D"):
        check_id_dtype(torch.zeros(2, 2, dtype=torch.int64), "x")
    assert first_out_of_range(torch.tensor([0, 7], dtype=torch.int32), 5) == 7


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_empty_jagged_tensor_has_empty_offsets(dtype):
    jt = JaggedTensor.empty(lengths_dtype=dtype)
    assert jt.offsets().dtype == dtype and jt.offsets().numel() == 0
    assert jt.lengths().numel() == 0 and jt.to_dense() == [] and jt.to_padded_dense().shape == (0, 0)
    assert str(jt) == "JaggedTensor({\n    []\n})\n"
    # any other JaggedTensor's offsets have len(lengths) + 1 entries
    with pytest.raises(ValueError, match="len\\(lengths\\) \\+ 1"):
        JaggedTensor(values=torch.arange(1), lengths=torch.tensor([1]), offsets=torch.tensor([], dtype=torch.int64))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("weighted", [False, True])
def test_traced_from_dense_lengths_matches_eager_and_lists(seed, weighted):
    g = torch.Generator().manual_seed(seed)
    values = torch.rand(5, 4, generator=g)
    weights = torch.rand(5, 4, generator=g) if weighted else None
    lengths = torch.randint(0, 5, (5,), generator=g, dtype=torch.int32)
    ref = [values[b, : int(n)].tolist() for b, n in enumerate(lengths)]
    traced = torch.fx.symbolic_trace(JaggedTensor.from_dense_lengths)
    for fn in (JaggedTensor.from_dense_lengths, traced):
        jt = fn(values, lengths, weights)
        assert _split(jt.values().tolist(), jt.lengths().tolist()) == ref
        if weighted:
            assert _split(jt.weights().tolist(), lengths.tolist()) == [weights[b, : int(n)].tolist() for b, n in enumerate(lengths)]
        else:
            assert jt.weights_or_none() is None


def test_meta_kjt_splits_its_values_evenly():
    """Meta tensors hold no lengths: length_per_key is an even split of the values, the rest to key 0 (TorchRec's),
    enough for shape propagation."""
    values = torch.empty(10, dtype=torch.int64, device="meta")
    offsets = torch.empty(7, dtype=torch.int64, device="meta")
    kjt = KeyedJaggedTensor.from_offsets_sync(keys=["a", "b", "c"], values=values, offsets=offsets)
    assert kjt.length_per_key() == [4, 3, 3] and kjt.offset_per_key() == [0, 4, 7, 10]
    lengths = torch.empty(6, dtype=torch.int32, device="meta")
    assert KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=values, lengths=lengths).length_per_key() == [5, 5]
    assert kjt.to_dict()["b"].values().shape == (3,)


def test_from_jt_dict_of_different_batch_sizes_is_variable_batch():
    a = JaggedTensor(values=torch.tensor([1.0, 2.0]), lengths=torch.tensor([2, 0], dtype=torch.int32),
                     weights=torch.tensor([1.0, 0.5]))
    b = JaggedTensor(values=torch.tensor([3.0, 4.0, 5.0]), lengths=torch.tensor([1, 1, 0, 1], dtype=torch.int32),
                     weights=torch.tensor([1.5, 1.0, 0.5]))
    kjt = KeyedJaggedTensor.from_jt_dict({"a": a, "b": b})
    assert kjt.variable_stride_per_key() and kjt.stride_per_key() == [2, 4]
    assert kjt.stride_per_key_per_rank() == [[2], [4]] and kjt.stride() == 4
    back = kjt.to_dict()
    for name, jt in (("a", a), ("b", b)):
        assert torch.equal(back[name].values(), jt.values()) and torch.equal(back[name].lengths(), jt.lengths())
        assert torch.equal(back[name].weights(), jt.weights())
    same = KeyedJaggedTensor.from_jt_dict({"a": a, "c": a})
    assert not same.variable_stride_per_key() and same.stride() == 2


def test_text_as_torchrec_prints_it():
    jt = JaggedTensor(values=torch.tensor([1.0, 2.0, 3.0]), lengths=torch.tensor([2, 0, 1]))
    assert str(jt) == "JaggedTensor({\n    [[1.0, 2.0], [], [3.0]]\n})\n"
    weighted = JaggedTensor(values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]), weights=torch.tensor([0.5, 1.0]))
    assert str(weighted) == 'JaggedTensor({\n    "values": [[1], [2]],\n    "weights": [[0.5], [1.0]]\n})\n'
    two_d = JaggedTensor(values=torch.tensor([[1, 2], [3, 4]]), lengths=torch.tensor([2]))
    assert str(two_d) == "JaggedTensor({\n    [[[1, 2], [3, 4]]]\n})\n"
    with pytest.raises(ValueError, match="1 or 2 dimensions"):
        str(JaggedTensor(values=torch.zeros(2, 1, 1), lengths=torch.tensor([2])))
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 0, 2, 0]),
                            weights=torch.tensor([1.0, 0.5, 2.0]))
    assert str(kjt) == ('KeyedJaggedTensor({\n    "a": {\n        "values": [[1], []],\n        "weights": [[1.0], []]\n'
                        '    },\n    "b": {\n        "values": [[2, 3], []],\n        "weights": [[0.5, 2.0], []]\n    }\n})\n')
    assert str(KeyedJaggedTensor.empty()) == "KeyedJaggedTensor()\n"


class _EmptyLikeSizes(torch.nn.Module):
    def forward(self, kjt: KeyedJaggedTensor) -> List[int]:
        e = KeyedJaggedTensor.empty_like(kjt)
        return [e.stride(), e.values().numel(), e.lengths().numel(), e.weights().numel()]


def test_empty_like_traces_and_scripts():
    """fx records empty_like as one call (it reads whether there are weights), so the graph scripts and answers as
    eager does."""
    kjt, _ = _float_kjt(0, ["a", "b"], batch=3)
    weighted = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                 weights=torch.rand(kjt.values().numel(), dtype=torch.float64))
    gm = torch.fx.symbolic_trace(_EmptyLikeSizes())
    scripted = torch.jit.script(gm)
    assert _EmptyLikeSizes()(weighted) == gm(weighted) == scripted(weighted) == [3, 0, 0, 0]
    e = KeyedJaggedTensor.empty_like(weighted)
    assert e.keys() == [] and (e.values().dtype, e.lengths().dtype, e.weights().dtype) == (
        torch.float32, torch.int32, torch.float64)
    assert KeyedJaggedTensor.empty_like(kjt).weights_or_none() is None
