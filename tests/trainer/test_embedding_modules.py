import pytest
import torch
import torch.fx

from recship.sparse import KeyedJaggedTensor
from recship.trainer import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    PoolingType,
    materialize,
)
from reference import random_kjt


def _tables(pooling=PoolingType.SUM):
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=50, feature_names=["f0", "f1"], pooling=pooling),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=30, feature_names=["f2"], pooling=pooling),
        EmbeddingBagConfig(name="t2", embedding_dim=12, num_embeddings=40, feature_names=["f3"], pooling=PoolingType.SUM),
    ]


def _reference_pooled(weights, ref, wref, pooling_per_feature, feature_order, table_of):
    """Plain-Python pooling: loops over examples and ids, reads rows of the weight matrices."""
    batch = len(next(iter(ref.values())))
    outs = []
    for f in feature_order:
        w = weights[table_of[f]]
        rows = []
        for b in range(batch):
            acc = torch.zeros(w.shape[1], dtype=torch.float64)
            ids = ref[f][b]
            for j, i in enumerate(ids):
                scale = wref[f][b][j] if wref is not None else 1.0
                acc += scale * w[i].double()
            if pooling_per_feature[f] == PoolingType.MEAN and ids:
                acc /= len(ids)
            rows.append(acc)
        outs.append(torch.stack(rows))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("values_dtype", [torch.int64, torch.int32])
def test_ebc_matches_python_reference(pooling, weighted, values_dtype):
    torch.manual_seed(0)
    tables = _tables(pooling)
    ebc = EmbeddingBagCollection(tables, is_weighted=weighted)
    kjt, ref, wref = random_kjt(["f3", "f0", "f2", "f1"], 6, seed=1, max_id=30, weighted=weighted, values_dtype=values_dtype)
    out = ebc(kjt)
    assert out.keys() == ["f0", "f1", "f2", "f3"]
    assert out.length_per_key() == [8, 8, 4, 12]
    weights = {t.name: ebc.embedding_bags[t.name].weight.detach() for t in tables}
    table_of = {f: t.name for t in tables for f in t.feature_names}
    pooling_of = {f: t.pooling for t in tables for f in t.feature_names}
    want = _reference_pooled(weights, ref, wref, pooling_of, out.keys(), table_of)
    assert out.values().dtype == torch.float32
    torch.testing.assert_close(out.values().double(), want, atol=1e-6, rtol=0)


def test_ebc_scripted_and_traced_equal_eager():
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables(PoolingType.MEAN), is_weighted=True)
    kjt, _, _ = random_kjt(["f0", "f1", "f2", "f3"], 5, seed=2, max_id=30, weighted=True)
    eager = ebc(kjt).values()
    assert torch.equal(torch.jit.script(ebc)(kjt).values(), eager)
    traced = torch.fx.symbolic_trace(ebc)
    assert torch.equal(traced(kjt).values(), eager)
    assert torch.equal(torch.jit.script(traced)(kjt).values(), eager)


def test_ebc_backward_matches_reference_gradient():
    torch.manual_seed(0)
    tables = _tables()
    ebc = EmbeddingBagCollection(tables)
    kjt, ref, _ = random_kjt(["f0", "f1", "f2", "f3"], 4, seed=3, max_id=30)
    ebc(kjt).values().sum().backward()
    # d(sum of pooled)/d(row i) = number of times id i was looked up in that table
    for t in tables:
        counts = torch.zeros(t.num_embeddings)
        for f in t.feature_names:
            for row in ref[f]:
                for i in row:
                    counts[i] += 1
        expect = counts.unsqueeze(1).expand(-1, t.embedding_dim)
        torch.testing.assert_close(ebc.embedding_bags[t.name].weight.grad, expect)


def test_ec_returns_rows_per_id():
    torch.manual_seed(0)
    ec = EmbeddingCollection(
        [
            EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=20, feature_names=["x", "y"]),
            EmbeddingConfig(name="b", embedding_dim=6, num_embeddings=20, feature_names=["z"]),
        ]
    )
    kjt, ref, _ = random_kjt(["z", "x", "y"], 3, seed=4, max_id=20)
    out = ec(kjt)
    scripted = torch.jit.script(ec)(kjt)
    assert list(out) == ["x", "y", "z"]
    for f, table in [("x", "a"), ("y", "a"), ("z", "b")]:
        w = ec.embeddings[table].weight.detach()
        rows = out[f].to_dense()
        assert [r.shape[0] for r in rows] == [len(ids) for ids in ref[f]]
        for got, ids in zip(rows, ref[f]):
            assert torch.equal(got, w[torch.tensor(ids, dtype=torch.int64)])
        assert torch.equal(scripted[f].values(), out[f].values())


def test_out_of_range_or_negative_id_is_an_error_not_row_zero():
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10)])
    for bad in (10, -1):
        kjt = KeyedJaggedTensor(keys=["t"], values=torch.tensor([1, bad]), lengths=torch.tensor([1, 1]))
        with pytest.raises(ValueError, match=f"^feature 't': id {bad} is out of range \\[0, 10\\)$"):
            ebc(kjt)
        with pytest.raises(RuntimeError, match="valid range|index_size"):
            torch.jit.script(ebc)(kjt)


def test_missing_feature_is_named():
    ebc = EmbeddingBagCollection(_tables())
    kjt, _, _ = random_kjt(["f0", "f1"], 2, seed=0, max_id=30)
    with pytest.raises(ValueError, match="lacks features \\['f2', 'f3'\\]"):
        ebc(kjt)


@pytest.mark.parametrize(
    "tables, message",
    [
        (
            [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=5), EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=5)],
            "duplicate table name",
        ),
        ([EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=5, data_type=DataType.INT8)], "recship.quantize"),
    ],
)
def test_bad_tables_raise(tables, message):
    with pytest.raises(ValueError, match=message):
        EmbeddingBagCollection(tables)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="", embedding_dim=4, num_embeddings=5), "needs a name"),
        (dict(name="a", embedding_dim=0, num_embeddings=5), "embedding_dim must be a positive int"),
        (dict(name="a", embedding_dim=4, num_embeddings=-1), "num_embeddings must be a positive int"),
        (dict(name="a", embedding_dim=4, num_embeddings=5, feature_names=["x", "x"]), "duplicate feature"),
        (dict(name="a", embedding_dim=4, num_embeddings=5, pooling=PoolingType.NONE), "SUM or MEAN"),
        (dict(name="a", embedding_dim=4, num_embeddings=5, weight_init_min=1.0, weight_init_max=0.0), "weight_init_min"),
    ],
)
def test_bad_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EmbeddingBagConfig(**kwargs)


def test_feature_names_default_to_table_name():
    assert EmbeddingBagConfig(name="user", embedding_dim=4, num_embeddings=5).feature_names == ["user"]


def test_state_dict_keys_follow_torchrec_names():
    ebc = EmbeddingBagCollection(_tables())
    assert sorted(ebc.state_dict()) == ["embedding_bags.t0.weight", "embedding_bags.t1.weight", "embedding_bags.t2.weight"]
    ec = EmbeddingCollection([EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=5)])
    assert list(ec.state_dict()) == ["embeddings.a.weight"]


class _Model(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=1000, weight_init_min=-0.01, weight_init_max=0.01)],
            device=device,
        )
        self.dense = torch.nn.Linear(8, 1, device=device)


def test_meta_device_allocates_nothing_then_materializes():
    model = _Model("meta")
    assert all(p.is_meta for p in model.parameters())
    torch.manual_seed(0)
    materialize(model, "cpu")
    w = model.ebc.embedding_bags["t"].weight
    assert not w.is_meta and w.device.type == "cpu"
    # the table follows its config's init range, not nn.EmbeddingBag's N(0, 1)
    w = w.detach()
    assert float(w.abs().max()) <= 0.01 and float(w.std()) > 0.001
    assert float(model.dense.weight.abs().sum()) > 0
    torch.manual_seed(0)
    again = materialize(_Model("meta"), "cpu")
    assert torch.equal(again.ebc.embedding_bags["t"].weight, w)


def test_default_init_range_is_inverse_sqrt_rows():
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=16, num_embeddings=400)])
    w = ebc.embedding_bags["t"].weight.detach()
    assert float(w.abs().max()) <= (1 / 400) ** 0.5
    assert float(w.abs().max()) > 0.9 * (1 / 400) ** 0.5
