import pytest
import torch

from recship.sparse import JaggedTensor


def test_tutorial_jagged_tensor():
    jt = JaggedTensor(values=torch.tensor([5, 7, 1]), lengths=torch.tensor([1, 2]))
    assert jt.offsets().tolist() == [0, 1, 3]
    assert [t.tolist() for t in jt.to_dense()] == [[5], [7, 1]]
    assert str(jt) == "JaggedTensor({\n    [[5], [7, 1]]\n})\n"


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("desired", [None, 2])
def test_to_padded_dense_matches_python(seed, desired):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (6,), generator=g)
    values = torch.randint(1, 50, (int(lengths.sum()),), generator=g)
    jt = JaggedTensor(values=values, lengths=lengths)
    rows = [r.tolist() for r in jt.to_dense()]
    width = desired if desired is not None else max(len(r) for r in rows)
    expect = [(r + [-1] * width)[:width] for r in rows]
    assert jt.to_padded_dense(desired, padding_value=-1).tolist() == expect


def test_offsets_and_lengths_must_agree_with_values():
    with pytest.raises(ValueError, match="sum\\(lengths\\) = 3"):
        JaggedTensor(values=torch.arange(2), offsets=torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="one weight per value"):
        JaggedTensor(values=torch.arange(2), lengths=torch.tensor([2]), weights=torch.ones(3))
    with pytest.raises(ValueError, match="no weights"):
        JaggedTensor(values=torch.arange(2), lengths=torch.tensor([2])).weights()


def test_two_dimensional_values():
    jt = JaggedTensor(values=torch.rand(5, 3), lengths=torch.tensor([2, 3]))
    assert [tuple(t.shape) for t in jt.to_dense()] == [(2, 3), (3, 3)]
    assert jt.to_padded_dense().shape == (2, 3, 3)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("weighted", [False, True])
def test_from_dense_matches_rows(seed, weighted):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 50, (int(n),), generator=g) for n in torch.randint(0, 4, (7,), generator=g)]
    wrows = [torch.rand(r.shape[0], generator=g) for r in rows] if weighted else None
    jt = JaggedTensor.from_dense(rows, wrows)
    assert jt.lengths().dtype == torch.int32
    assert jt.lengths().tolist() == [r.numel() for r in rows]
    assert [t.tolist() for t in jt.to_dense()] == [r.tolist() for r in rows]
    if weighted:
        assert [t.tolist() for t in jt.to_dense_weights()] == [w.tolist() for w in wrows]
    else:
        assert jt.weights_or_none() is None


def test_from_dense_torchrec_example_and_errors():
    # TorchRec 1.8.0 gives lengths [1, 0, 2] (int32) and offsets [0, 1, 1, 3] here.
    jt = JaggedTensor.from_dense([torch.tensor([1.0]), torch.tensor([]), torch.tensor([7.0, 8.0])])
    assert jt.values().tolist() == [1.0, 7.0, 8.0]
    assert jt.offsets().tolist() == [0, 1, 1, 3] and jt.offsets().dtype == torch.int32
    two_d = JaggedTensor.from_dense([torch.ones(2, 3), torch.zeros(1, 3)])
    assert two_d.lengths().tolist() == [2, 1] and two_d.values().shape == (3, 3)
    with pytest.raises(ValueError, match="empty list"):
        JaggedTensor.from_dense([])
    with pytest.raises(ValueError, match="2 weight rows for 1 value rows"):
        JaggedTensor.from_dense([torch.arange(2)], [torch.ones(1), torch.ones(1)])
    with pytest.raises(ValueError, match="weights\\[1\\] has shape"):
        JaggedTensor.from_dense([torch.arange(2), torch.arange(1)], [torch.ones(2), torch.ones(2)])


@pytest.mark.parametrize("weighted", [False, True])
def test_empty(weighted):
    jt = JaggedTensor.empty(weighted, None, torch.int64, torch.float64, torch.int64)
    assert (jt.values().dtype, jt.lengths().dtype) == (torch.int64, torch.int64)
    assert jt.values().numel() == 0 and jt.lengths().numel() == 0
    # as TorchRec's: empty offsets of the lengths' dtype (the one JaggedTensor without len(lengths) + 1 of them)
    assert jt.offsets().dtype == torch.int64 and jt.offsets().numel() == 0
    assert jt.to_dense() == [] and jt.to_padded_dense().shape == (0, 0)
    if weighted:
        assert jt.weights().dtype == torch.float64
    else:
        assert jt.weights_or_none() is None
    default = JaggedTensor.empty()
    assert (default.values().dtype, default.lengths().dtype) == (torch.get_default_dtype(), torch.int32)
