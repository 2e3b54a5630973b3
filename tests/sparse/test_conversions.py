"""TorchRec's KJT helpers in recship.sparse (conversions, the constructors' precomputed arguments, the PT2 checks):
against per-key slicing of seeded inputs, round trips, and the errors for values that disagree."""

import logging

import pytest
import torch

import recship
from recship.sparse import (ComputeJTDictToKJT, ComputeKJTToJTDict, KeyedJaggedTensor, KeyedTensor, flatten_kjt_list,
                            is_pt2_compiling, maybe_td_to_kjt, pt2_checks_all_is_size, unflatten_kjt_list,
                            validate_keyed_jagged_tensor)
from recship.trainer import EmbeddingBagConfig


def _kjt(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (6,), generator=g)
    values = torch.randint(0, 9, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=lengths, weights=torch.rand(values.numel(), generator=g))


def _vbe():
    return KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(5), lengths=torch.tensor([1, 2, 0, 1, 1]),
                             stride_per_key_per_rank=[[2], [3]],
                             inverse_indices=(["a", "b"], torch.tensor([[0, 1, 1], [2, 0, 1]])))


def _same(x, y):
    return (x.keys() == y.keys() and torch.equal(x.values(), y.values()) and torch.equal(x.lengths(), y.lengths())
            and x.stride_per_key() == y.stride_per_key())


def test_dict_modules_round_trip_and_trace():
    kjt = _kjt(1)
    d = ComputeKJTToJTDict()(kjt)
    n = int(kjt.lengths()[:3].sum())
    assert torch.equal(d["a"].values(), kjt.values()[:n]) and torch.equal(d["b"].weights(), kjt.weights()[n:])
    back = ComputeJTDictToKJT()(d)
    assert _same(back, kjt) and torch.equal(back.weights(), kjt.weights())
    traced = torch.fx.symbolic_trace(ComputeKJTToJTDict())
    assert torch.equal(traced(kjt)["b"].lengths(), kjt.lengths()[3:])


def test_flatten_and_unflatten_a_list_of_kjts():
    kjts = [_kjt(2), _vbe()]
    flat, contexts = flatten_kjt_list(kjts)
    assert len(flat) == 12 and contexts == [["a", "b"], ["a", "b"]]
    assert flat[4] is None and flat[5] is None and flat[10].tolist() == [[2], [3]]
    again = unflatten_kjt_list(flat, contexts)
    assert all(_same(x, y) for x, y in zip(again, kjts))
    assert torch.equal(again[1].inverse_indices()[1], kjts[1].inverse_indices()[1])
    with pytest.raises(ValueError, match="7 tensors for 1 KeyedJaggedTensors"):
        unflatten_kjt_list(flat[:7], contexts[:1])


def test_maybe_td_to_kjt_takes_nested_jagged_tensors():
    rows = {"a": [torch.tensor([1, 2]), torch.tensor([3])], "b": [torch.tensor([], dtype=torch.int64), torch.tensor([4, 5, 6])]}
    td = {k: torch.nested.nested_tensor(v, layout=torch.jagged) for k, v in rows.items()}
    kjt = maybe_td_to_kjt(td)
    assert kjt.keys() == ["a", "b"] and kjt.values().tolist() == [1, 2, 3, 4, 5, 6] and kjt.lengths().tolist() == [2, 1, 0, 3]
    assert maybe_td_to_kjt(td, ["b"]).values().tolist() == [4, 5, 6]
    assert maybe_td_to_kjt(kjt) is kjt
    with pytest.raises(TypeError, match="not a nested jagged tensor"):
        maybe_td_to_kjt({"a": torch.ones(2)})


def test_validate(caplog):
    kjt = _kjt(3)
    assert validate_keyed_jagged_tensor(kjt)
    high = int(kjt.values().max())
    fits = [EmbeddingBagConfig(name="t", num_embeddings=high + 1, embedding_dim=4, feature_names=["a", "b"])]
    short = [EmbeddingBagConfig(name="t", num_embeddings=high, embedding_dim=4, feature_names=["a", "b"])]
    assert validate_keyed_jagged_tensor(kjt, fits)
    with caplog.at_level(logging.WARNING):
        assert not validate_keyed_jagged_tensor(kjt, short)
    assert f"..{high}, outside its table's [0, {high})" in caplog.text
    assert recship.validate_keyed_jagged_tensor is validate_keyed_jagged_tensor
    repeated = KeyedJaggedTensor(keys=["a", "a"], values=torch.arange(2), lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="keys repeat"):
        validate_keyed_jagged_tensor(repeated)


def test_precomputed_constructor_arguments_are_checked_and_used():
    kjt = _kjt(4)
    lpk = kjt.length_per_key()
    opk = [0, lpk[0], lpk[0] + lpk[1]]
    given = KeyedJaggedTensor(keys=["a", "b"], values=kjt.values(), lengths=kjt.lengths(), stride_per_key=[3, 3],
                              lengths_offset_per_key=[0, 3, 6], offset_per_key=opk, index_per_key={"a": 0, "b": 1})
    assert given.offset_per_key() == opk and torch.equal(given["b"].values(), kjt["b"].values())
    for name, value, message in [("stride_per_key", [2, 4], "stride_per_key"),
                                 ("offset_per_key", [0, 1, 2], "non-decreasing offsets"),
                                 ("index_per_key", {"a": 1, "b": 0}, "index_per_key"),
                                 ("lengths_offset_per_key", [0, 2, 6], "lengths_offset_per_key")]:
        with pytest.raises(ValueError, match=message):
            KeyedJaggedTensor(keys=["a", "b"], values=kjt.values(), lengths=kjt.lengths(), **{name: value})
    d = kjt.to_dict()
    assert KeyedJaggedTensor(keys=["a", "b"], values=kjt.values(), lengths=kjt.lengths(), jt_dict=d).to_dict() is d
    assert KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(5), lengths=torch.tensor([1, 2, 0, 1, 1]),
                             stride_per_key_per_rank=[[2], [3]], stride_per_key=[2, 3]).stride_per_key() == [2, 3]
    kt = KeyedTensor(keys=["x", "y"], length_per_key=[2, 3], values=torch.randn(2, 5), offset_per_key=[0, 2, 5],
                     index_per_key={"x": 0, "y": 1})
    assert kt.offset_per_key() == [0, 2, 5]
    with pytest.raises(ValueError, match="offset_per_key"):
        KeyedTensor(keys=["x", "y"], length_per_key=[2, 3], values=torch.randn(2, 5), offset_per_key=[0, 3, 5])


def test_scripted_kjt_takes_the_new_arguments():
    @torch.jit.script
    def build(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        kjt = KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=lengths, offset_per_key=[0, 2, 3],
                                stride_per_key=None, lengths_offset_per_key=None, index_per_key=None, jt_dict=None,
                                weights=None, offsets=None, stride=None, stride_per_key_per_rank=None, length_per_key=None,
                                inverse_indices=None)
        return kjt["b"].values()

    assert build(torch.tensor([4, 5, 6]), torch.tensor([2, 0, 1, 0])).tolist() == [6]


def test_pt2_checks_are_identity_outside_compilation_and_true_inside():
    assert not is_pt2_compiling() and pt2_checks_all_is_size([1, 2]) == [1, 2]

    @torch.compile(backend="eager", fullgraph=True)
    def scaled(x):
        return x * 2 if is_pt2_compiling() else x * 3

    assert scaled(torch.ones(1)).item() == 2.0
