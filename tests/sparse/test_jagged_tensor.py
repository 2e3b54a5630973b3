import pytest
import torch

from recship.sparse import JaggedTensor


def test_tutorial_jagged_tensor():
    jt = JaggedTensor(values=torch.tensor([5, 7, 1]), lengths=torch.tensor([1, 2]))
    assert jt.offsets().tolist() == [0, 1, 3]
    assert [t.tolist() for t in jt.to_dense()] == [[5], [7, 1]]
    assert str(jt) == "JaggedTensor({\n    [[5], [7, 1]]\n})"


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
