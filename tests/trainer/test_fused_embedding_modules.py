"""Fused embedding collections (TorchRec's fused_embedding_modules): the update made in backward equals plain torch's
embedding modules stepped by the same torch optimizer, for random seeded batches.

Checked against TorchRec 1.8.0 on CPU besides (not here: no TorchRec in the tests): for SGD, Adagrad and
RowWiseAdagrad, weighted or not, SUM or MEAN, the initial weights, outputs, weights after each of 3 steps (a learning
rate changed between) and the optimizer state were bit-equal to TorchRec's FusedEmbeddingBagCollection's.
"""

import pytest
import torch
from torch import nn

from recship import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor, PoolingType
from recship.trainer.fused_embedding_modules import (
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
    convert_optimizer_type_and_kwargs,
    fuse_embedding_optimizer,
)
from recship.trainer.fused_optim import FusedOptimizer, FusedOptimizerModule, RowWiseAdagrad

B = 5
ROWS = {"f1": 10, "f2": 12, "f3": 12}


def bag_tables(mean: bool = False):
    return [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=12, feature_names=["f2", "f3"],
                           pooling=PoolingType.MEAN if mean else PoolingType.SUM),
    ]


def batches(seed: int, steps: int = 3, weighted: bool = False):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        lengths = torch.randint(0, 4, (3 * B,), generator=g)
        ids = torch.cat([torch.randint(0, ROWS[f], (int(lengths[i * B:(i + 1) * B].sum()),), generator=g)
                         for i, f in enumerate(ROWS)])
        weights = torch.rand(ids.numel(), generator=g) if weighted else None
        yield KeyedJaggedTensor(keys=list(ROWS), values=ids, lengths=lengths, weights=weights), torch.randn(B, 20, generator=g)


def reference_bags(fused: FusedEmbeddingBagCollection, weighted: bool) -> nn.ModuleDict:
    """Plain nn.EmbeddingBag per table with the fused module's weights."""
    bags = nn.ModuleDict()
    for t in fused.embedding_bag_configs():
        mode = "mean" if t.pooling == PoolingType.MEAN and not weighted else "sum"
        bags[t.name] = nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=mode)
        bags[t.name].weight.data.copy_(fused.state_dict()[f"embedding_bags.{t.name}.weight"])
    return bags


def reference_forward(bags: nn.ModuleDict, tables, kjt: KeyedJaggedTensor, weighted: bool) -> torch.Tensor:
    d = kjt.to_dict()
    out = []
    for t in tables:
        for f in t.feature_names:
            jt = d[f]
            pooled = bags[t.name](jt.values(), jt.offsets()[:-1], per_sample_weights=jt.weights() if weighted else None)
            if weighted and t.pooling == PoolingType.MEAN:  # fbgemm divides the weighted sum by the bag's length
                pooled = pooled / jt.lengths().clamp(min=1).unsqueeze(1)
            out.append(pooled)
    return torch.cat(out, dim=1)


CASES = [
    (torch.optim.SGD, {"lr": 0.1}, {}),
    (torch.optim.Adagrad, {"lr": 0.1}, {"eps": 1e-8}),  # fused: fbgemm's eps (1e-8), as TorchRec's; torch's is 1e-10
    (torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-3}, {}),
    (RowWiseAdagrad, {"lr": 0.1, "eps": 1e-6}, {}),
]


@pytest.mark.parametrize("optimizer_type,kwargs,torch_extra", CASES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("mean", [False, True])
def test_fused_bags_train_as_torch_optimizer_steps(optimizer_type, kwargs, torch_extra, weighted, mean):
    torch.manual_seed(0)
    tables = bag_tables(mean)
    fused = FusedEmbeddingBagCollection(tables, optimizer_type, kwargs, is_weighted=weighted)
    bags = reference_bags(fused, weighted)
    opt = optimizer_type(bags.parameters(), **kwargs, **torch_extra)
    for kjt, target in batches(1, weighted=weighted):
        kt = fused(kjt)
        assert kt.keys() == ["f1", "f2", "f3"] and kt.values().shape == (B, 20)
        want = reference_forward(bags, tables, kjt, weighted)
        torch.testing.assert_close(kt.values(), want, rtol=1e-6, atol=1e-6)
        (kt.values() * target).sum().backward()
        opt.zero_grad()
        (want * target).sum().backward()
        opt.step()
        for t in tables:
            torch.testing.assert_close(fused.state_dict()[f"embedding_bags.{t.name}.weight"], bags[t.name].weight.detach(),
                                       rtol=1e-5, atol=1e-6)
    if optimizer_type is not torch.optim.SGD:
        state = fused.fused_optimizer().state_dict()["state"]
        assert sorted(state) == ["t1.weight", "t2.weight"]
        momentum = state["t1.weight"]["t1.weight.momentum_1"]
        ref = opt.state[bags["t1"].weight]["sum"]
        torch.testing.assert_close(momentum, ref.reshape(momentum.shape), rtol=1e-5, atol=1e-7)


def test_learning_rate_change_applies_from_next_backward():
    torch.manual_seed(0)
    fused = FusedEmbeddingBagCollection(bag_tables(), torch.optim.SGD, {"lr": 0.1})
    before = fused.state_dict()["embedding_bags.t1.weight"].clone()
    fused.fused_optimizer().param_groups[0]["lr"] = 0.5
    fused.fused_optimizer().zero_grad()
    kjt = KeyedJaggedTensor(["f1", "f2", "f3"], torch.tensor([3]), lengths=torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]))
    fused(kjt).values().sum().backward()
    after = fused.state_dict()["embedding_bags.t1.weight"]
    torch.testing.assert_close(before[3] - after[3], torch.full((4,), 0.5))
    assert torch.equal(before[1], after[1])


def test_state_dict_keys_and_load_write_into_the_kernel():
    torch.manual_seed(0)
    fused = FusedEmbeddingBagCollection(bag_tables(), torch.optim.SGD, {"lr": 0.1})
    assert list(fused.state_dict()) == ["embedding_bags.t1.weight", "embedding_bags.t2.weight"]
    assert isinstance(fused, FusedOptimizerModule)
    assert all(isinstance(opt, FusedOptimizer) for _, opt in fused.fused_optimizer().optimizers)
    plain = EmbeddingBagCollection(bag_tables())
    fused.load_state_dict(plain.state_dict())
    kjt, _ = next(batches(2))
    torch.testing.assert_close(fused(kjt).values(), plain(kjt).values())


def test_interleaved_poolings_keep_config_order():
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
        EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=12, feature_names=["f2"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=12, feature_names=["f3"]),
    ]
    fused = FusedEmbeddingBagCollection(tables, torch.optim.SGD, {"lr": 0.1})
    plain = EmbeddingBagCollection(tables)
    plain.load_state_dict(fused.state_dict())
    kjt, _ = next(batches(3))
    out = fused(kjt)
    assert out.keys() == ["f1", "f2", "f3"]
    torch.testing.assert_close(out.values(), plain(kjt).values())


def test_fused_collection_trains_as_sgd_on_cpu():
    torch.manual_seed(0)
    tables = [EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
              EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=12, feature_names=["f2", "f3"])]
    fused = FusedEmbeddingCollection(tables, torch.optim.SGD, {"lr": 0.2}, need_indices=True)
    assert list(fused.state_dict()) == ["embeddings.t1.weight", "embeddings.t2.weight"]
    plain = EmbeddingCollection(tables)
    plain.load_state_dict(fused.state_dict())
    opt = torch.optim.SGD(plain.parameters(), lr=0.2)
    for kjt, _ in batches(4):
        got, want = fused(kjt), plain(kjt)
        assert list(got) == ["f1", "f2", "f3"]
        g = torch.Generator().manual_seed(5)
        loss_got = loss_want = 0
        for f in got:
            assert torch.equal(got[f].lengths(), want[f].lengths()) and torch.equal(got[f].weights(), kjt[f].values())
            torch.testing.assert_close(got[f].values(), want[f].values())
            target = torch.randn(want[f].values().shape, generator=g)
            loss_got = loss_got + (got[f].values() * target).sum()
            loss_want = loss_want + (want[f].values() * target).sum()
        loss_got.backward()
        opt.zero_grad()
        loss_want.backward()
        opt.step()
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(fused.state_dict()[key], value)
    assert fused.embedding_dim() == 4 and fused.embedding_names_by_table() == [["f1"], ["f2", "f3"]]


def test_fuse_embedding_optimizer_keeps_weights_and_weighting():
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.sparse = nn.Module()
            self.sparse.ebc = EmbeddingBagCollection(bag_tables(), is_weighted=True)
            self.dense = nn.Linear(20, 1)

        def forward(self, kjt):
            return self.dense(self.sparse.ebc(kjt).values())

    model = Model()
    kjt, _ = next(batches(6, weighted=True))
    want = model(kjt)
    fused = fuse_embedding_optimizer(model, RowWiseAdagrad, {"lr": 0.1}, torch.device("cpu"))
    assert fused is model and isinstance(model.sparse.ebc, FusedEmbeddingBagCollection) and model.sparse.ebc.is_weighted()
    torch.testing.assert_close(model(kjt), want)
    top = fuse_embedding_optimizer(EmbeddingBagCollection(bag_tables()), torch.optim.SGD, {"lr": 0.1}, torch.device("cpu"))
    assert isinstance(top, FusedEmbeddingBagCollection)


def test_convert_optimizer_type_and_kwargs():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    kwargs = {"lr": 0.3, "eps": 0.1}
    assert convert_optimizer_type_and_kwargs(torch.optim.Adagrad, kwargs) == (EmbOptimType.EXACT_ADAGRAD, {"learning_rate": 0.3, "eps": 0.1})
    assert kwargs == {"lr": 0.3, "eps": 0.1}
    assert convert_optimizer_type_and_kwargs(RowWiseAdagrad, {})[0] == EmbOptimType.EXACT_ROWWISE_ADAGRAD
    assert convert_optimizer_type_and_kwargs(torch.optim.RMSprop, {"lr": 0.1}) is None


@pytest.mark.parametrize("optimizer_type,kwargs,words", [
    (torch.optim.RMSprop, {"lr": 0.1}, "Cannot fuse"),
    (torch.optim.Adam, {"lr": 0.1}, "CUDA only"),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "['momentum'] cannot be fused"),
    (torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.01}, "weight_decay"),
])
def test_refuses_what_cannot_be_fused(optimizer_type, kwargs, words):
    with pytest.raises(ValueError) as e:
        FusedEmbeddingBagCollection(bag_tables(), optimizer_type, kwargs)
    assert words in str(e.value)


def test_refuses_bad_inputs_and_moves():
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    with pytest.raises(ValueError, match="needs device=cuda"):
        FusedEmbeddingBagCollection(bag_tables(), torch.optim.SGD, {}, location=EmbeddingLocation.DEVICE)
    with pytest.raises(ValueError, match="one embedding_dim"):
        FusedEmbeddingCollection([EmbeddingConfig(name="a", embedding_dim=8, num_embeddings=3),
                                  EmbeddingConfig(name="b", embedding_dim=4, num_embeddings=3)], torch.optim.SGD, {})
    with pytest.raises(ValueError, match="multiple of 4"):
        FusedEmbeddingBagCollection([EmbeddingBagConfig(name="a", embedding_dim=6, num_embeddings=3)], torch.optim.SGD, {})
    fused = FusedEmbeddingBagCollection(bag_tables(), torch.optim.SGD, {"lr": 0.1})
    bad = KeyedJaggedTensor(["f1", "f2", "f3"], torch.tensor([10]), lengths=torch.tensor([1] + [0] * 14))
    with pytest.raises(ValueError, match="f1"):
        fused(bad)
    weighted = FusedEmbeddingBagCollection(bag_tables(), torch.optim.SGD, {"lr": 0.1}, is_weighted=True)
    with pytest.raises(ValueError, match="needs weights"):
        weighted(next(batches(0))[0])
    with pytest.raises(ValueError, match="cannot be moved or cast"):
        fused.double()
