"""A checkpoint in TorchRec's layout, written on 2 gloo ranks by plain torch (no recship code) as TorchRec's
DistributedModelParallel writes it: ``dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()})``
with every table a row-wise ShardedTensor under ``<module>.embedding_bags.<table>.weight`` and the row-wise adagrad
state under ``<table>.momentum1``. recship's DMP loads it at world 2 under another plan (bitwise), and
``recship export`` exports it like the same weights exported from memory."""

import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from gloo_ranks import gather_whole, run_ranks
from model_requests import ModelInputs, in_process, random_request
from recship.export import ExportConfig, export_model
from recship.export.artifact import Manifest, open_artifact
from recship.models import TwoTower
from recship.trainer.checkpoint_reader import CheckpointReader
from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
from recship.trainer.model_parallel import DistributedModelParallel
from recship.trainer.planner import EmbeddingShardingPlanner, ParameterConstraints, ShardingType, Topology

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

ARGS = {"num_users": 300, "num_items": 500, "num_countries": 20, "num_categories": 30, "dim": 16, "num_dense": 4}


def _source():
    """The weights the TorchRec job holds (full tensors) and its row-wise adagrad state, per table key."""
    torch.manual_seed(3)
    model = TwoTower(**ARGS)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(4)
    tables = [k for k in state if ".embedding_bags." in k]
    return model, state, {k: torch.rand(state[k].shape[0], generator=g) for k in tables}


def _row_wise(full, rank, world_size):
    """TorchRec's row-wise ShardedTensor of ``full``: blocks of ceil(rows / world) rows, rank r the r-th block."""
    rows = full.shape[0]
    block = -(-rows // world_size)
    lo, hi = min(rows, rank * block), min(rows, (rank + 1) * block)
    offsets = [lo] + [0] * (full.dim() - 1)
    shard = Shard(full[lo:hi].clone(), ShardMetadata(offsets, list(full[lo:hi].shape), f"rank:{rank}/cpu"))
    return init_from_local_shards([shard], *full.shape)


def _worker(rank, world_size, path):
    _, state, momentum = _source()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_sd = {k: _row_wise(v, rank, world_size) if k in momentum else v for k, v in state.items()}
        optim_sd = {"state": {k: {f"{k.split('.')[-2]}.momentum1": _row_wise(m, rank, world_size)} for k, m in momentum.items()}}
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    dist.barrier()
    # recship: another model's weights, table-wise, then the TorchRec checkpoint loaded into it
    torch.manual_seed(9)
    model = TwoTower(**ARGS)
    constraints = {t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE])
                   for m in (model.user_tables, model.item_tables) for t in m.embedding_bag_configs()}
    plan = EmbeddingShardingPlanner(Topology(world_size, "cpu"), constraints=constraints).collective_plan(model)
    dmp = DistributedModelParallel(model, plan=plan, optimizer=FusedOptimizerConfig(EmbOptimType.EXACT_ROWWISE_ADAGRAD))
    sd, osd = dmp.state_dict(), dmp.fused_optimizer.state_dict()
    dcp.load({"model": sd, "optim": osd}, checkpoint_id=path)
    dmp.load_state_dict(sd)
    dmp.fused_optimizer.load_state_dict(osd)
    return {"model": {k: gather_whole(v) for k, v in dmp.state_dict().items()},
            # a rank has the optimizer state of its own tables only (TorchRec's): their local shards, joined by the test
            "momentum": {k: {tuple(sh.metadata.shard_offsets): sh.tensor.clone() for sh in st[f"{k.split('.')[-2]}.momentum1"].local_shards()}
                         for k, st in dmp.fused_optimizer.state_dict()["state"].items()}}


def test_a_torchrec_checkpoint_loads_into_a_recship_dmp_and_exports(tmp_path):
    path = tmp_path / "torchrec_ckpt"
    results = run_ranks(_worker, 2, str(path))
    source, state, momentum = _source()
    assert sorted(results[0]["model"]) == sorted(state)
    for k, v in state.items():
        assert torch.equal(results[0]["model"][k], v), k
    assert sorted(set(results[0]["momentum"]) | set(results[1]["momentum"])) == sorted(momentum)
    for k, v in momentum.items():
        got = torch.full_like(v, float("nan"))
        for r in results:
            for (offset,), t in r["momentum"].get(k, {}).items():
                got[offset : offset + t.numel()] = t
        assert torch.equal(got, v), k

    # read without a process group: TorchRec's keys, the tables whole
    reader = CheckpointReader(path)
    assert sorted(f"{m}.embedding_bags.{c.name}.weight" for m, c in reader.table_configs()) == sorted(momentum)
    for mpath, cfg, weight in reader.tables():
        assert torch.equal(weight, state[f"{mpath}.embedding_bags.{cfg.name}.weight"])
    dense = reader.dense_state_dict()
    assert sorted(dense) == sorted(k for k in state if k not in momentum)
    assert all(torch.equal(v, state[k]) for k, v in dense.items())

    # export names the model (the checkpoint records none) and equals the same weights exported from memory
    common = dict(progress=False, validation_batch_size=32, eval_data="eval_data_helper:two_tower_batches")
    streamed = export_model(path, ExportConfig(out=str(tmp_path / "streamed"), model="recship.models:TwoTower", model_args=ARGS, **common))
    in_memory = export_model(source, ExportConfig(out=str(tmp_path / "memory"), **common))
    assert streamed["validation"]["float_auc"] == in_memory["validation"]["float_auc"]
    assert streamed["validation"]["auc"] == in_memory["validation"]["auc"]
    m1, _ = open_artifact(tmp_path / "streamed")
    m2, _ = open_artifact(tmp_path / "memory")
    sparse, dense_in, _ = random_request(ModelInputs.of(Manifest.from_dict(streamed)), 9, 4)
    want = in_process(m2, sparse, dense_in)
    for k, v in in_process(m1, sparse, dense_in).items():
        np.testing.assert_array_equal(v, want[k])
