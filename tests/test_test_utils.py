"""``torchrec.distributed.test_utils`` through the import map (recship.test_utils): ModelInput.generate draws from
torch's global generator in TorchRec's order (checked against a plain-torch re-derivation of the draws; bit-equal to
TorchRec 1.8.0's batches in a throwaway venv), its local batches tile the global one, TestSparseNN computes what its
archs say (a plain-torch reference from its state_dict), and it trains under DistributedModelParallel on 2 gloo ranks
as one process does on the global batch."""

from pathlib import Path
from typing import Dict, List

import pytest
import torch
from torch import nn

from gloo_ranks import run_ranks
from recship.trainer import EmbeddingBagConfig
from tutorials.notebook import rewrite_imports, import_map

USER_CODE = (Path(__file__).parent / "snippets" / "torchrec_test_utils.txt").read_text()  # TorchRec user code
LR, STEPS = 0.5, 3


@pytest.fixture(scope="module")
def trec():
    scope: Dict[str, object] = {}
    exec(compile(rewrite_imports(USER_CODE, import_map()), "user_code", "exec"), scope)
    return scope


def _tables(count: int = 4, prefix: str = "") -> List[EmbeddingBagConfig]:
    """TorchRec's test tables: table i has (i + 1) * 10 rows of width (i + 2) * 4."""
    return [EmbeddingBagConfig(num_embeddings=(i + 1) * 10, embedding_dim=(i + 2) * 4, name=f"{prefix}table_{i}",
                               feature_names=[f"{prefix}feature_{i}"]) for i in range(count)]


def test_generate_draws_in_torchrecs_order_and_splits_per_rank(trec):
    tables, weighted = _tables(2), _tables(1, "weighted_")
    whole, local = trec["ModelInput"].generate(batch_size=3, world_size=2, num_float_features=5, tables=tables,
                                               weighted_tables=weighted, random_seed=7)
    torch.manual_seed(7)  # the reference: each feature's lengths then ids, the weighted ones with weights, then dense and label
    want_lengths, want_ids = [], []
    for rows in (10, 20):
        lengths = torch.abs(torch.randn(6) + 10).to(torch.int64)
        want_lengths.append(lengths)
        want_ids.append(torch.randint(0, rows, (int(lengths.sum()),)))
    score_lengths = torch.abs(torch.randn(6) + 10).to(torch.int64)
    score_ids = torch.randint(0, 10, (int(score_lengths.sum()),))
    score_weights = torch.rand(score_ids.numel())
    dense, label = torch.rand(6, 5), torch.rand(6)
    assert whole.idlist_features.keys() == ["feature_0", "feature_1"]
    assert torch.equal(whole.idlist_features.lengths(), torch.cat(want_lengths))
    assert torch.equal(whole.idlist_features.values(), torch.cat(want_ids))
    assert torch.equal(whole.idscore_features.values(), score_ids) and torch.equal(whole.idscore_features.weights(), score_weights)
    assert torch.equal(whole.float_features, dense) and torch.equal(whole.label, label)
    for r, batch in enumerate(local):  # rank r holds examples 3r..3r+2 of every feature
        rows = slice(3 * r, 3 * r + 3)
        assert torch.equal(batch.float_features, dense[rows]) and torch.equal(batch.label, label[rows])
        for f, jt in batch.idlist_features.to_dict().items():
            bags, whole_bags = jt.to_dense(), whole.idlist_features[f].to_dense()[rows]
            assert len(bags) == 3 and all(torch.equal(a, b) for a, b in zip(bags, whole_bags))
    again, _ = trec["ModelInput"].generate(batch_size=3, world_size=2, num_float_features=5, tables=tables, weighted_tables=weighted,
                                           random_seed=7)
    assert torch.equal(again.idlist_features.values(), whole.idlist_features.values())
    with pytest.raises(ValueError, match="same length"):
        trec["ModelInput"].generate(batch_size=3, world_size=2, num_float_features=5, tables=tables, weighted_tables=weighted,
                                    tables_pooling=[1])


def test_generate_options(trec):
    tables = _tables(2)
    whole, local = trec["ModelInput"].generate(batch_size=4, world_size=2, num_float_features=3, tables=tables, weighted_tables=[],
                                               random_seed=1, variable_batch_size=True, max_feature_lengths=[2, 3],
                                               power_law_alpha=1.5, use_offsets=True, tables_pooling=[5, 9])
    lengths = whole.idlist_features.lengths().view(2, 8)
    assert int(lengths[0].max()) <= 2 and int(lengths[1].max()) <= 3
    assert torch.equal(lengths[:, 7], torch.zeros(2, dtype=torch.int64))  # rank 1 keeps 4 - 1 examples
    assert whole.idscore_features is None and int(whole.idlist_features.values().max()) < 20
    assert [b.idlist_features.lengths().numel() for b in local] == [8, 6]
    vb, vb_local = trec["ModelInput"].generate_variable_batch_input(average_batch_size=2, world_size=2, num_float_features=3,
                                                                    tables=tables, random_seed=4)
    assert vb.idlist_features.variable_stride_per_key() and vb.float_features.shape == (8, 3)
    assert [b.idlist_features.inverse_indices()[1].shape for b in vb_local] == [(2, 4), (2, 4)]
    assert whole.size_in_bytes() > 0 and whole.to(torch.device("cpu")).label is not None


def _reference_pred(model: nn.Module, batch) -> torch.Tensor:
    """TestSparseNN's eval prediction from its state_dict, in plain torch."""
    sd = model.state_dict()
    dense = batch.float_features @ sd["dense.linear.weight"].T + sd["dense.linear.bias"]
    pooled = []
    for kjt, prefix in ((batch.idlist_features, "sparse.ebc"), (batch.idscore_features, "sparse.weighted_ebc")):
        for f, jt in kjt.to_dict().items():
            table = f.replace("feature", "table")
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), jt.lengths().cumsum(0)])[:-1]
            pooled.append(nn.functional.embedding_bag(jt.values(), sd[f"{prefix}.embedding_bags.{table}.weight"], offsets, mode="sum",
                                                      per_sample_weights=jt.weights_or_none()))
    x = torch.cat([dense, *pooled], dim=1)
    h = x @ sd["over.dhn_arch.linear0.weight"].T + sd["over.dhn_arch.linear0.bias"]
    h = h @ sd["over.dhn_arch.linear1.weight"].T + sd["over.dhn_arch.linear1.bias"]
    return torch.sigmoid(h.mean(dim=1)) + 1


def test_test_sparse_nn_computes_its_archs(trec):
    tables, weighted = _tables(), _tables(2, "weighted_")
    torch.manual_seed(0)
    model = trec["TestSparseNN"](tables=tables, weighted_tables=weighted, num_float_features=5)
    assert sorted(k for k in model.state_dict() if not k.startswith("sparse")) == [
        "dense.dummy_buffer", "dense.dummy_param", "dense.linear.bias", "dense.linear.weight", "dummy_ones",
        "over.dhn_arch.linear0.bias", "over.dhn_arch.linear0.weight", "over.dhn_arch.linear1.bias", "over.dhn_arch.linear1.weight"]
    batch, _ = trec["ModelInput"].generate(batch_size=3, world_size=2, num_float_features=5, tables=tables, weighted_tables=weighted,
                                           random_seed=7)
    loss, pred = model(batch)
    want = _reference_pred(model, batch)
    torch.testing.assert_close(pred, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(loss, nn.functional.binary_cross_entropy_with_logits(want, batch.label), atol=1e-6, rtol=1e-6)
    model.eval()
    assert model(batch).shape == (6,)
    large = trec["TestSparseNN"](tables=tables, weighted_tables=weighted, num_float_features=5, max_feature_lengths={"table_1": 6},
                                 over_arch_clazz=trec["TestOverArchLarge"])
    assert "sparse.fp_ebc._feature_processors.position_weights.table_1" in large.state_dict() and large(batch)[1].shape == (6,)
    for cls in ("TestTowerSparseNN", "TestTowerCollectionSparseNN"):
        tower = trec[cls](tables=tables, weighted_tables=weighted, num_float_features=5)
        tower.eval()
        assert tower(batch).shape == (6,)
    with pytest.raises(ValueError, match="needs at least 4 tables"):
        trec["TestTowerSparseNN"](tables=tables[:2], weighted_tables=weighted)


def _train_worker(rank: int, world_size: int) -> Dict[str, object]:
    from recship.distributed import (DefaultDataParallelWrapper, DistributedModelParallel, ShardingPlan, construct_module_sharding_plan,
                                     row_wise, table_wise)
    from recship.test_utils import ModelInput, TestEBCSharder, TestSparseNN
    from recship.trainer.fused_optim import EmbOptimType

    tables, weighted = _tables(), _tables(2, "weighted_")
    torch.manual_seed(0)
    model = TestSparseNN(tables=tables, weighted_tables=weighted, num_float_features=5)
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    sharder = TestEBCSharder("row_wise", "fused", fused_params=fused)
    plan = ShardingPlan({
        "sparse.ebc": construct_module_sharding_plan(model.sparse.ebc, {f"table_{i}": row_wise() if i % 2 else table_wise(rank=i // 2)
                                                                        for i in range(4)}, local_size=world_size,
                                                     world_size=world_size, device_type="cpu"),
        "sparse.weighted_ebc": construct_module_sharding_plan(model.sparse.weighted_ebc, {"weighted_table_0": table_wise(rank=1),
                                                                                          "weighted_table_1": row_wise()},
                                                              local_size=world_size, world_size=world_size, device_type="cpu")})
    # TorchRec's DDP settings (static graph): TestSparseNN's dummy_param gets no gradient
    dmp = DistributedModelParallel(model, plan=plan, sharders=[sharder], data_parallel_wrapper=DefaultDataParallelWrapper())
    dense = torch.optim.SGD(dmp.dense_parameters(), lr=LR)
    for step in range(STEPS):
        _, local = ModelInput.generate(batch_size=3, world_size=world_size, num_float_features=5, tables=tables,
                                       weighted_tables=weighted, random_seed=100 + step)
        loss, _ = dmp(local[rank])
        loss.backward()
        dense.step()
        dense.zero_grad()
    out: Dict[str, object] = {k: v.detach().clone() for k, v in dmp.module.over.state_dict().items()}
    out.update({f"dense.{k}": v.detach().clone() for k, v in dmp.module.dense.state_dict().items()})
    for path, names in (("ebc", [f"table_{i}" for i in range(4)]), ("weighted_ebc", ["weighted_table_0", "weighted_table_1"])):
        sharded = getattr(dmp.module.sparse, path)
        out.update({name: sharded.gather_table(name) for name in names})
    return out


def test_test_sparse_nn_trains_on_two_ranks_like_one_process():
    from recship.test_utils import ModelInput, TestSparseNN

    tables, weighted = _tables(), _tables(2, "weighted_")
    torch.manual_seed(0)
    model = TestSparseNN(tables=tables, weighted_tables=weighted, num_float_features=5)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        whole, _ = ModelInput.generate(batch_size=3, world_size=2, num_float_features=5, tables=tables, weighted_tables=weighted,
                                       random_seed=100 + step)
        loss, _ = model(whole)
        loss.backward()
        opt.step()
        opt.zero_grad()
    want = model.state_dict()
    assert not torch.equal(want["sparse.ebc.embedding_bags.table_1.weight"], start["sparse.ebc.embedding_bags.table_1.weight"])
    results = run_ranks(_train_worker, 2)
    for r, got in enumerate(results):
        for k in ("dhn_arch.linear0.weight", "dhn_arch.linear1.bias"):
            torch.testing.assert_close(got[k], want[f"over.{k}"], atol=1e-6, rtol=1e-5, msg=f"rank {r} {k}")
        torch.testing.assert_close(got["dense.linear.weight"], want["dense.linear.weight"], atol=1e-6, rtol=1e-5)
    for name in [f"table_{i}" for i in range(4)]:
        torch.testing.assert_close(results[0][name], want[f"sparse.ebc.embedding_bags.{name}.weight"], atol=1e-6, rtol=1e-5, msg=name)
    for name in ("weighted_table_0", "weighted_table_1"):
        torch.testing.assert_close(results[0][name], want[f"sparse.weighted_ebc.embedding_bags.{name}.weight"], atol=1e-6, rtol=1e-5)
