"""TorchRec's state_dict of DistributedModelParallel on 2 gloo ranks, one table per sharding type.

References: the unsharded model's state_dict (keys and shapes: TorchRec's documented
``<path>.embedding_bags.<table>.weight``), and the same model trained in one process with plain
torch optimizers (torch.optim.Adagrad for the tables, the update fbgemm's EXACT_ADAGRAD fuses;
SGD for the dense part and the data-parallel table). Checkpoints go through
torch.distributed.checkpoint (DCP): saved at world 2, loaded at world 2 (bitwise), at world 1
into a DMP of another plan, and into the unsharded model without a process group (bitwise).
"""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from gloo_ranks import gather_whole, run_ranks
from recship.distributed import (ShardingPlan, column_wise, construct_module_sharding_plan, data_parallel, row_wise,
                                 table_row_wise, table_wise)
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
from recship.trainer.model_parallel import DistributedModelParallel, in_backward_optimizer_filter
from test_sharded_ebc import LOCAL_BATCH, global_batch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torch.distributed._shard.sharded_tensor import ShardedTensor

LR = 0.1
EPS = 1e-8
STEPS = 2
WORLD = 2


def _tables():
    return [
        EmbeddingBagConfig(name="tw", num_embeddings=7, embedding_dim=4, feature_names=["f_tw"]),
        EmbeddingBagConfig(name="rw", num_embeddings=11, embedding_dim=8, feature_names=["f_rw"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="cw", num_embeddings=9, embedding_dim=8, feature_names=["f_cw"]),
        EmbeddingBagConfig(name="twrw", num_embeddings=10, embedding_dim=4, feature_names=["f_twrw"]),
        EmbeddingBagConfig(name="dp", num_embeddings=5, embedding_dim=4, feature_names=["f_dp"]),
    ]


class Toy(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.sparse = EmbeddingBagCollection(_tables(), device=device)
        self.over = nn.Linear(28, 1, device=device)

    def forward(self, kjt):
        return self.over(self.sparse(kjt).values())


def _plan(model, world_size, split=True):
    """Each table under its own sharding type at world 2; at world 1 (split=False) another plan: all table-wise."""
    if not split:
        shardings = {t.name: (data_parallel() if t.name == "dp" else table_wise(rank=0)) for t in _tables()}
    else:
        shardings = {"tw": table_wise(rank=1), "rw": row_wise(), "cw": column_wise(ranks=[0, 1]),
                     "twrw": table_row_wise(host_index=0), "dp": data_parallel()}
    return ShardingPlan({"sparse": construct_module_sharding_plan(model.sparse, shardings, local_size=world_size,
                                                                  world_size=world_size, device_type="cpu")})


def _targets(step):
    return torch.randn(WORLD * LOCAL_BATCH, 1, generator=torch.Generator().manual_seed(100 + step))


def _single_process():
    """The reference: the unsharded model, Adagrad on the sharded tables, SGD on the rest, the global batch."""
    torch.manual_seed(0)
    model = Toy()
    tables = [model.sparse.embedding_bags[t.name].weight for t in _tables() if t.name != "dp"]
    sparse_opt = torch.optim.Adagrad(tables, lr=LR, eps=EPS)
    dense_opt = torch.optim.SGD([p for p in model.parameters() if all(p is not t for t in tables)], lr=LR)
    for step in range(STEPS):
        kjt, _ = global_batch(_tables(), WORLD, seed=step, weighted=False)
        nn.functional.mse_loss(model(kjt), _targets(step)).backward()
        sparse_opt.step()
        dense_opt.step()
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
    return model, {f"sparse.embedding_bags.{t.name}.weight": sparse_opt.state[p]["sum"] for t, p in
                   zip([t for t in _tables() if t.name != "dp"], tables)}


def _dmp(seed, world_size, split=True, optimizer=EmbOptimType.EXACT_ADAGRAD):
    torch.manual_seed(seed)
    model = Toy()
    return DistributedModelParallel(model, plan=_plan(model, world_size, split),
                                    optimizer=FusedOptimizerConfig(optimizer, learning_rate=LR, eps=EPS))


def _local(value):
    """This rank's shards of a ShardedTensor (by offsets), or the tensor: what must survive a round trip bitwise."""
    if isinstance(value, ShardedTensor):
        return {tuple(s.metadata.shard_offsets): s.tensor.clone() for s in value.local_shards()}
    return value.detach().clone()


def _world2(rank, world_size, path):
    dmp = _dmp(0, world_size)
    dense_opt = torch.optim.SGD(dmp.dense_parameters(), lr=LR)
    for step in range(STEPS):
        _, local = global_batch(_tables(), world_size, seed=step, weighted=False)
        target = _targets(step)[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        nn.functional.mse_loss(dmp(local[rank]), target).backward()
        dense_opt.step()
        dense_opt.zero_grad()
    sd = dmp.state_dict()
    osd = dmp.fused_optimizer.state_dict()
    out = {
        "module_is_unwrapped": type(dmp.module).__name__,
        "keys": {k: (type(v).__name__, list(v.size() if isinstance(v, ShardedTensor) else v.shape)) for k, v in sd.items()},
        "tables": {k: gather_whole(v) for k, v in sd.items()},
        "optim_keys": {k: {n: list(s.size()) for n, s in st.items()} for k, st in osd["state"].items()},
        "momentum": {k: (list(st[k.split(".")[-2] + ".momentum1"].size()), _local(st[k.split(".")[-2] + ".momentum1"]))
                     for k, st in osd["state"].items()},
        "fused_names": sorted(n for n, _ in in_backward_optimizer_filter(dmp.named_parameters(), include=True)),
        "dense_names": sorted(n for n, _ in in_backward_optimizer_filter(dmp.named_parameters())),
    }
    dcp.save({"model": sd, "optim": osd}, checkpoint_id=path)
    # load at world 2 into a DMP of other weights: bitwise, weights, optimizer state and outputs
    other = _dmp(1, world_size)
    sd2, osd2 = other.state_dict(), other.fused_optimizer.state_dict()
    dcp.load({"model": sd2, "optim": osd2}, checkpoint_id=path)
    other.load_state_dict(sd2)
    other.fused_optimizer.load_state_dict(osd2)
    mine, theirs = other.state_dict(), other.fused_optimizer.state_dict()
    out["same_weights"] = all(_equal(_local(sd[k]), _local(mine[k])) for k in sd)
    out["same_state"] = all(_equal(_local(v), _local(theirs["state"][k][n])) for k, st in osd["state"].items() for n, v in st.items())
    _, local = global_batch(_tables(), world_size, seed=7, weighted=False)
    out["same_output"] = torch.equal(dmp(local[rank]), other(local[rank]))
    # the views: a write through the state_dict's shard is the TBE's weight (zero copy)
    st = other.state_dict()["sparse.embedding_bags.rw.weight"]
    shard = st.local_shards()[0].tensor
    shard.fill_(3.0)
    tbe_views = [w for (t, _), w in other.module.sparse.local_shards().items() if t == "rw"]  # split_embedding_weights()
    out["view"] = len(tbe_views) == 1 and bool((tbe_views[0] == 3.0).all()) and bool((other.module.sparse.embedding_bags["rw"].weight == 3.0).all())
    # loading the unsharded model's full tables (TorchRec's pre-load hook slices them)
    torch.manual_seed(0)
    full = Toy()
    other.load_state_dict({k: v for k, v in full.state_dict().items()})
    out["from_full"] = {k: gather_whole(v) for k, v in other.state_dict().items()}
    # row-wise adagrad: TorchRec's 1-D layout ([rows], column-wise tables [columns shards * rows])
    rowwise = _dmp(0, world_size, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    out["rowwise"] = {k: {n: list(s.size()) for n, s in st.items()} for k, st in rowwise.fused_optimizer.state_dict()["state"].items()}
    sgd = _dmp(0, world_size, optimizer=EmbOptimType.EXACT_SGD)
    out["sgd"] = sgd.fused_optimizer.state_dict()["state"]
    return out


def _assemble(results, key):
    """A fused-optimizer state gathered in this process from every rank's local shards (ranks without one lack the key)."""
    size = next(r["momentum"][key][0] for r in results if key in r["momentum"])
    full = torch.full(size, float("nan"))
    for r in results:
        for offsets, t in r["momentum"].get(key, (None, {}))[1].items():
            full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
    return full


def _equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


def _world1(rank, world_size, path):
    dmp = _dmp(5, world_size, split=False)
    sd, osd = dmp.state_dict(), dmp.fused_optimizer.state_dict()
    dcp.load({"model": sd, "optim": osd}, checkpoint_id=path)
    dmp.load_state_dict(sd)
    dmp.fused_optimizer.load_state_dict(osd)
    return {"tables": {k: gather_whole(v) for k, v in dmp.state_dict().items()},
            "momentum": {k: gather_whole(st[k.split(".")[-2] + ".momentum1"]) for k, st in dmp.fused_optimizer.state_dict()["state"].items()}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    return path, run_ranks(_world2, WORLD, path)


def test_keys_and_global_shapes_are_the_unsharded_models(saved):
    _, results = saved
    want = {k: list(v.shape) for k, v in Toy(device="meta").state_dict().items()}
    for r in results:
        assert r["module_is_unwrapped"] == "Toy"
        assert {k: shape for k, (_, shape) in r["keys"].items()} == want
        kinds = {k: kind for k, (kind, _) in r["keys"].items()}
        assert all(kinds[f"sparse.embedding_bags.{t}.weight"] == "ShardedTensor" for t in ("tw", "rw", "cw", "twrw"))
        assert kinds["sparse.embedding_bags.dp.weight"] == kinds["over.weight"] == "Tensor"
        assert r["fused_names"] == [f"sparse.embedding_bags.{t}.weight" for t in ("cw", "rw", "tw", "twrw")]
        assert r["dense_names"] == ["over.bias", "over.weight", "sparse.embedding_bags.dp.weight"]
    # TorchRec's fused optimizer state: the parameter's name -> {"<table>.momentum1": [rows, dim]} for adagrad, for
    # the tables with a shard on the rank (table-wise "tw" lives on rank 1 only)
    for r, tables in zip(results, (("rw", "cw", "twrw"), ("tw", "rw", "cw", "twrw"))):
        assert r["optim_keys"] == {f"sparse.embedding_bags.{t.name}.weight": {f"{t.name}.momentum1": [t.num_embeddings, t.embedding_dim]}
                                   for t in _tables() if t.name in tables}
        # row-wise adagrad: 1-D, [rows]; a column-wise table's 2 shards each keep theirs: [2 * rows]
        assert r["rowwise"] == {f"sparse.embedding_bags.{t.name}.weight": {f"{t.name}.momentum1": [t.num_embeddings * (2 if t.name == "cw" else 1)]}
                                for t in _tables() if t.name in tables}
        assert r["sgd"] == {f"sparse.embedding_bags.{t}.weight": {} for t in tables}


def test_tables_read_by_name_equal_the_single_process_training(saved):
    _, results = saved
    reference, sums = _single_process()
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(results[0]["tables"][k], v, atol=1e-5, rtol=0)
        torch.testing.assert_close(results[1]["tables"][k], v, atol=1e-5, rtol=0) if "over" in k or ".dp." in k else None
    for k, v in sums.items():
        torch.testing.assert_close(_assemble(results, k), v, atol=1e-5, rtol=0)
    assert not torch.equal(results[0]["tables"]["sparse.embedding_bags.cw.weight"], Toy().sparse.embedding_bags["cw"].weight)


def test_dcp_round_trip_at_world_2_is_bitwise_and_the_shards_are_views(saved):
    _, results = saved
    for r in results:
        assert r["same_weights"] and r["same_state"] and r["same_output"] and r["view"]
    # a full (unsharded) state_dict loads into the sharded model: each rank keeps its slices
    torch.manual_seed(0)
    for k, v in Toy().state_dict().items():
        assert torch.equal(results[0]["from_full"][k], v), k


def test_dcp_checkpoint_of_world_2_loads_at_world_1_under_another_plan(saved):
    path, results = saved
    (one,) = run_ranks(_world1, 1, path)
    for k, v in results[0]["tables"].items():
        assert torch.equal(one["tables"][k], v), k
    assert sorted(one["momentum"]) == [f"sparse.embedding_bags.{t}.weight" for t in ("cw", "rw", "tw", "twrw")]
    for k, v in one["momentum"].items():
        assert torch.equal(v, _assemble(results, k)), k


def test_dcp_checkpoint_of_world_2_loads_into_the_unsharded_model_without_a_process_group(saved):
    path, results = saved
    model = Toy()
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that there is no process group: on purpose
        dcp.load({"model": sd}, checkpoint_id=path, no_dist=True)
    model.load_state_dict(sd)
    for k, v in model.state_dict().items():
        assert torch.equal(v, results[0]["tables"][k]), k
