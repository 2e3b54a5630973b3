"""Shared features (TorchRec's): one feature looked up by several tables of a collection.

Each table pools (or gathers) the feature's ids on its own; the outputs are named ``feature@table`` (a feature only
one table looks up keeps its name), table by table, as TorchRec's ``get_embedding_names_by_table``. An id must lie
inside every table the feature feeds. Checked against plain PyTorch (``F.embedding_bag`` / indexing per table) for the
float, fused and quantized collections, fx and TorchScript, and sharded EmbeddingCollections on 2 gloo ranks
(sharded EmbeddingBagCollections: tests/trainer/distributed/test_sharded_ebc.py, whose tables share a feature).
Export and serving: tests/export/test_shared_feature_export.py.
"""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gloo_ranks import run_ranks
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, PoolingType
from recship.trainer.entry_point import describe_model
from recship.trainer.fused_embedding_modules import FusedEmbeddingBagCollection, FusedEmbeddingCollection

KEYS = ["f1", "f2"]


def bag_tables():
    # f1 feeds t1 (SUM, 10 rows) and t2 (MEAN, 6 rows): its ids stay below 6
    return [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=6, feature_names=["f1"], pooling=PoolingType.MEAN)]


def seq_tables():
    return [EmbeddingConfig(name="t1", embedding_dim=8, num_embeddings=10, feature_names=["f1", "f2"]),
            EmbeddingConfig(name="t2", embedding_dim=8, num_embeddings=6, feature_names=["f2"])]


def random_kjt(seed: int, batch: int = 5, weighted: bool = False) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(KEYS) * batch,), generator=g)
    values = torch.randint(0, 6, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, weights=weights)


def pooled_reference(weights, tables, kjt, weighted):
    """{output name: [B, dim]}: each (table, feature) pooled by F.embedding_bag on that table alone."""
    out = {}
    per_key = kjt.to_dict()
    for t in tables:
        for f in t.feature_names:
            name = f if sum(f in u.feature_names for u in tables) == 1 else f"{f}@{t.name}"
            jt = per_key[f]
            w = jt.weights() if weighted else None
            summed = F.embedding_bag(jt.values(), weights[t.name], jt.offsets()[:-1], mode="sum", per_sample_weights=w)
            if t.pooling == PoolingType.MEAN:
                summed = summed / jt.lengths().clamp(min=1).unsqueeze(1)
            out[name] = summed
    return out


@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_outputs_are_named_feature_at_table_and_equal_each_tables_own_pooling(weighted):
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(bag_tables(), is_weighted=weighted)
    weights = {n: bag.weight.detach() for n, bag in ebc.embedding_bags.items()}
    kjt = random_kjt(1, weighted=weighted)
    want = pooled_reference(weights, bag_tables(), kjt, weighted)
    for module in (ebc, torch.fx.symbolic_trace(ebc), torch.jit.script(ebc)):
        kt = module(kjt)
        assert kt.keys() == ["f1@t1", "f2", "f1@t2"]
        assert kt.length_per_key() == [4, 4, 8]
        for name, rows in kt.to_dict().items():
            torch.testing.assert_close(rows, want[name], rtol=0, atol=1e-6)


def test_a_shared_features_id_must_be_inside_every_table_it_feeds():
    ebc = EmbeddingBagCollection(bag_tables())
    kjt = KeyedJaggedTensor(keys=KEYS, values=torch.tensor([7, 1]), lengths=torch.tensor([1, 0, 1, 0]))  # 7: inside t1 only
    with pytest.raises(ValueError, match=r"feature 'f1': id 7 is out of range \[0, 6\)"):
        ebc(kjt)


def test_sequence_outputs_are_named_feature_at_table_and_are_each_tables_rows():
    torch.manual_seed(0)
    ec = EmbeddingCollection(seq_tables(), need_indices=True)
    assert ec.embedding_names_by_table() == [["f1", "f2@t1"], ["f2@t2"]]
    kjt = random_kjt(2)
    per_key = kjt.to_dict()
    for module in (ec, torch.jit.script(ec)):
        out = module(kjt)
        assert list(out) == ["f1", "f2@t1", "f2@t2"]
        for name, table, feature in (("f1", "t1", "f1"), ("f2@t1", "t1", "f2"), ("f2@t2", "t2", "f2")):
            assert torch.equal(out[name].values(), ec.embeddings[table].weight.detach()[per_key[feature].values()])
            assert torch.equal(out[name].lengths(), per_key[feature].lengths())
            assert torch.equal(out[name].weights(), per_key[feature].values())


def test_fused_collections_train_each_table_on_the_shared_features_gradient():
    """One SGD step in backward equals plain SGD on the float collection's gradients."""
    lr = 0.5
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(bag_tables())
    fused = FusedEmbeddingBagCollection(bag_tables(), torch.optim.SGD, {"lr": lr})
    fused.load_state_dict(ebc.state_dict())
    kjt = random_kjt(3)
    got, want = fused(kjt), ebc(kjt)
    assert got.keys() == want.keys()
    torch.testing.assert_close(got.values(), want.values(), rtol=0, atol=1e-6)
    scale = torch.arange(1.0, want.values().shape[1] + 1)
    (want.values() * scale).sum().backward()
    (got.values() * scale).sum().backward()
    for name, bag in ebc.embedding_bags.items():
        torch.testing.assert_close(fused.embedding_bags[name].weight, bag.weight.detach() - lr * bag.weight.grad, rtol=0, atol=1e-6)

    ec = EmbeddingCollection(seq_tables())
    fused_ec = FusedEmbeddingCollection(seq_tables(), torch.optim.SGD, {"lr": lr})
    fused_ec.load_state_dict(ec.state_dict())
    assert fused_ec.embedding_names_by_table() == ec.embedding_names_by_table()
    got_rows, want_rows = fused_ec(kjt), ec(kjt)
    assert list(got_rows) == list(want_rows)
    for name in want_rows:
        torch.testing.assert_close(got_rows[name].values(), want_rows[name].values(), rtol=0, atol=0)


def test_quantized_collections_keep_the_names_and_fp32_the_numbers():
    from recship.quantize.modules import quantize_embeddings

    torch.manual_seed(0)
    ebc, ec = EmbeddingBagCollection(bag_tables()), EmbeddingCollection(seq_tables())
    kjt = random_kjt(4)
    quantized, _ = quantize_embeddings(nn.ModuleList([ebc, ec]), dtype="fp32")
    kt = quantized[0](kjt)
    assert kt.keys() == ebc(kjt).keys()
    torch.testing.assert_close(kt.values(), ebc(kjt).values(), rtol=0, atol=1e-6)  # fbgemm's fp32 sums in its own order
    rows, want = quantized[1](kjt), ec(kjt)
    assert list(rows) == list(want)
    assert all(torch.equal(rows[k].values(), want[k].values()) for k in want)  # rows copied, no arithmetic
    int8, _ = quantize_embeddings(nn.ModuleList([ebc]), dtype="int8")
    assert torch.jit.script(int8[0])(kjt).keys() == ["f1@t1", "f2", "f1@t2"]


class SharedRanker(nn.Module):
    num_dense = 2

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(bag_tables())
        self.over = nn.Linear(2 + 16, 1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(torch.cat([dense, self.ebc(features).values()], dim=1))


def test_the_model_contract_lists_a_shared_feature_once_with_its_smallest_table():
    """(export and serving of such a model: tests/export/test_shared_feature_export.py)"""
    spec = describe_model(SharedRanker())
    assert [(f, t.name) for f, _, t, _, _ in spec["features"]] == [("f1", "t2"), ("f2", "t1")]  # t2: 6 rows bound f1's ids
    assert spec["shared"] == {"f1": ["t1", "t2"]}
    assert [t.name for _, t in spec["tables"]] == ["t1", "t2"]


def test_a_managed_collision_collection_refuses_a_shared_feature():
    """Its remapped KJT carries each feature once: two tables' remappings of one feature would collide."""
    from recship.trainer.managed_collisions import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule

    modules = {t.name: MCHManagedCollisionModule(zch_size=t.num_embeddings, device=torch.device("cpu"),
                                                 eviction_policy=LFU_EvictionPolicy(), eviction_interval=1)
               for t in bag_tables()}
    with pytest.raises(ValueError, match="feature 'f1' feeds tables 't1' and 't2'"):
        ManagedCollisionCollection(modules, bag_tables())


CASES = {"table_wise": ("table_wise", "table_wise"), "row_wise": ("row_wise", "row_wise"),
         "column_wise": ("column_wise", "table_wise")}


def _sharded_ec_worker(rank: int, world_size: int):
    from recship.distributed import (DistributedModelParallel, EmbeddingCollectionSharder, ShardingPlan, column_wise,
                                     construct_module_sharding_plan, row_wise, table_wise)

    per_type = {"table_wise": lambda i: table_wise(rank=i), "row_wise": lambda i: row_wise(),
                "column_wise": lambda i: column_wise(ranks=[0, 1])}
    results = {}
    for case, (first, second) in CASES.items():
        torch.manual_seed(0)
        ec = EmbeddingCollection(seq_tables())
        reference = copy.deepcopy(ec)
        plan = construct_module_sharding_plan(ec, {"t1": per_type[first](0), "t2": per_type[second](1)}, world_size=world_size,
                                              device_type="cpu")
        dmp = DistributedModelParallel(ec, plan=ShardingPlan({"": plan}), sharders=[EmbeddingCollectionSharder()])
        kjt = random_kjt(10 + rank)
        got = dmp(kjt)
        got = got.wait() if hasattr(got, "wait") else got
        want = reference(kjt)
        results[case] = (list(got), list(want), all(torch.equal(got[k].values(), want[k].values()) for k in want))
    return results


def test_sharded_embedding_collection_looks_a_shared_feature_up_in_each_table_on_two_ranks():
    for per_rank in run_ranks(_sharded_ec_worker, 2):
        for case, (got, want, equal) in per_rank.items():
            assert got == want == ["f1", "f2@t1", "f2@t2"], case
            assert equal, case
