"""TensorPool, KeyedJaggedTensorPool and their lookups (TorchRec's tensor_pool, keyed_jagged_tensor_pool,
object_pool_lookups) against a plain Python dictionary of rows, with random seeded updates.

Checked against TorchRec 1.8.0 besides (not here): the same updates gave bit-equal lookups and state_dicts.
"""

import pytest
import torch

from recship import KeyedJaggedTensor
from recship.models.object_pools import (
    KeyedJaggedTensorPool,
    ObjectPool,
    TensorJaggedIndexSelectLookup,
    TensorLookup,
    TensorPool,
)
from recship.sparse import JaggedTensor


def test_tensor_pool_keeps_the_last_row_per_id():
    g = torch.Generator().manual_seed(0)
    pool = TensorPool(pool_size=12, dim=3, dtype=torch.float)
    assert isinstance(pool, ObjectPool) and pool.pool_size == 12 and pool.device == torch.device("cpu")
    want = {}
    for _ in range(4):
        ids = torch.randint(0, 12, (6,), generator=g)
        values = torch.randn(6, 3, generator=g)
        pool.update(ids, values)
        for i, row in zip(ids.tolist(), values):
            want[i] = row
    query = torch.arange(12)
    expected = torch.stack([want.get(i, torch.zeros(3)) for i in range(12)])
    assert torch.equal(pool(query), expected) and torch.equal(pool.state_dict()["_pool"], expected)
    loaded = TensorPool(12, 3, torch.float, loaded_values=expected.clone())
    assert torch.equal(loaded.lookup(torch.tensor([4, 4, 0])), expected[[4, 4, 0]])


def test_tensor_pool_refuses_bad_input():
    pool = TensorPool(4, 2, torch.float)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        pool.lookup(torch.tensor([4]))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        pool.lookup(torch.tensor([-1]))
    with pytest.raises(ValueError, match="torch.float32"):
        pool.update(torch.tensor([0]), torch.ones(1, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="UVM"):
        TensorPool(4, 2, torch.float, enable_uvm=True)


FEATURES = {"a": 3, "b": 2, "c": 4}


def random_update(g: torch.Generator, batch: int, weighted: bool):
    keys = ["c", "x", "a", "b"]  # another order, and a key the pool does not keep
    most = {**FEATURES, "x": 5}
    lengths = torch.cat([torch.randint(0, most[k] + 1, (batch,), generator=g) for k in keys])
    values = torch.randint(0, 1000, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    ids = torch.randint(0, 10, (batch,), generator=g)
    return ids, KeyedJaggedTensor(keys, values, weights=weights, lengths=lengths)


@pytest.mark.parametrize("weighted", [False, True])
def test_kjt_pool_against_a_dictionary(weighted):
    g = torch.Generator().manual_seed(1)
    pool = KeyedJaggedTensorPool(10, FEATURES, is_weighted=weighted)
    rows = {}  # id -> {feature: (values, weights)}
    for _ in range(4):
        ids, kjt = random_update(g, 5, weighted)
        pool.update(ids, kjt)
        per_feature = kjt.to_dict()
        for b, i in enumerate(ids.tolist()):
            rows[i] = {}
            for f in FEATURES:
                jt = per_feature[f]
                start, end = int(jt.offsets()[b]), int(jt.offsets()[b + 1])
                rows[i][f] = (jt.values()[start:end], jt.weights()[start:end] if weighted else None)
    query = torch.tensor([9, 0, 4, 4, 2, 7, 1, 5, 3, 6, 8])
    out = pool.lookup(query)
    assert out.keys() == list(FEATURES) and out.stride() == len(query)
    empty = (torch.zeros(0, dtype=torch.int64), torch.zeros(0))
    for f, jt in out.to_dict().items():
        picked = [rows.get(i, {}).get(f, empty) for i in query.tolist()]
        assert jt.lengths().tolist() == [len(v) for v, _ in picked]
        assert torch.equal(jt.values(), torch.cat([v for v, _ in picked]))
        if weighted:
            assert torch.equal(jt.weights(), torch.cat([w if w is not None else torch.zeros(0) for _, w in picked]))
    assert out.lengths().dtype == torch.int32
    keys = ["values", "key_lengths"] + (["weights"] if weighted else [])
    assert list(pool.state_dict()) == keys
    copy = KeyedJaggedTensorPool(10, FEATURES, is_weighted=weighted)
    copy.load_state_dict(pool.state_dict())
    again = copy.lookup(query)
    assert torch.equal(again.values(), out.values()) and torch.equal(again.lengths(), out.lengths())


def test_kjt_pool_refuses_bad_input():
    pool = KeyedJaggedTensorPool(10, {"a": 1})
    too_long = KeyedJaggedTensor(["a"], torch.tensor([1, 2]), lengths=torch.tensor([2]))
    with pytest.raises(ValueError, match="'a' has an example of 2 values"):
        pool.update(torch.tensor([0]), too_long)
    with pytest.raises(ValueError, match="lacks the pool's features"):
        pool.update(torch.tensor([0]), KeyedJaggedTensor(["b"], torch.tensor([1]), lengths=torch.tensor([1])))
    with pytest.raises(ValueError, match="2 ids for a KeyedJaggedTensor of 1"):
        pool.update(torch.tensor([0, 1]), KeyedJaggedTensor(["a"], torch.tensor([1]), lengths=torch.tensor([1])))
    with pytest.raises(ValueError, match="holds torch.int64 values"):
        pool.update(torch.tensor([0]), KeyedJaggedTensor(["a"], torch.tensor([1], dtype=torch.int32), lengths=torch.tensor([1])))
    with pytest.raises(ValueError, match="values_dtype"):
        KeyedJaggedTensorPool(10, {"a": 1}, values_dtype=torch.float)


def test_lookups():
    lookup = TensorJaggedIndexSelectLookup(5, torch.int64, {"a": 2, "b": 2}, False, torch.device("cpu"))
    lookup.update(torch.tensor([1, 3]), JaggedTensor(values=torch.tensor([1, 2, 3, 4, 5]), lengths=torch.tensor([1, 2, 2, 0])))
    out = lookup(torch.tensor([3, 1, 0]))
    assert out.values().tolist() == [[4], [5], [1], [2], [3]] and out.lengths().tolist() == [2, 0, 1, 2, 0, 0]
    dense = TensorLookup(4, 2, torch.float, torch.device("cpu"))
    dense.update(torch.tensor([2]), torch.tensor([[1.0, 2.0]]))
    assert torch.equal(dense(torch.tensor([2, 0])), torch.tensor([[1.0, 2.0], [0.0, 0.0]]))
    dense.set_state(torch.ones(4, 2))
    assert [name for name, _ in dense.states_to_register()] == ["_pool"] and torch.equal(dense.lookup(torch.tensor([3])), torch.ones(1, 2))
