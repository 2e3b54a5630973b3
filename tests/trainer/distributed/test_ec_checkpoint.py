"""A sharded EmbeddingCollection's state and checkpoints: state_dict() has the unsharded model's keys, its tables
TorchRec's ShardedTensors ([rows, dim], this rank's row block); a DCP checkpoint saved row-wise on 2 gloo ranks loads
table-wise on 2 ranks (resharded: the same weights, and the row-wise adagrad state too, since a further step gives the
same weights as the saving run's own next step) and in one process without a process group (the full tables)."""

import torch
from torch import nn

from gloo_ranks import run_ranks
from recship.trainer.checkpoint import load_checkpoint, save_checkpoint
from recship.trainer.checkpoint_reader import CheckpointReader
from recship.trainer.distributed.sharders import EmbeddingCollectionSharder
from recship.trainer.fused_optim import EmbOptimType
from recship.trainer.model_parallel import DistributedModelParallel
from test_ec_sharding import LOCAL_BATCH, SeqModel, batch, plan_for

LR = 0.1


def _dmp(case: str):
    torch.manual_seed(0)
    model = SeqModel()
    sharder = EmbeddingCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR})
    dmp = DistributedModelParallel(model, plan=plan_for(model, case), sharders=[sharder])
    return dmp, torch.optim.SGD(dmp.dense_parameters(), lr=LR)


def _step(dmp, dense, rank: int, step: int) -> None:
    kjt, target = batch(step, rank * LOCAL_BATCH, LOCAL_BATCH)
    nn.functional.mse_loss(dmp(kjt), target).backward()
    dense.step()
    dense.zero_grad()


def _tables(dmp):
    ec = dmp.module.ec
    return {t: ec.gather_table(t) for t in ("seq", "hist")}


def _save_worker(rank: int, world_size: int, root: str):
    dmp, dense = _dmp("row_wise")
    for step in range(2):
        _step(dmp, dense, rank, step)
    state = dmp.state_dict()
    seq = state["ec.embeddings.seq.weight"]
    keys = {k: (type(v).__name__, list(v.size())) for k, v in state.items()}
    local = [(list(s.metadata.shard_offsets), list(s.tensor.shape)) for s in seq.local_shards()]
    path = save_checkpoint(root, 2, dmp, dense)
    saved = _tables(dmp)
    _step(dmp, dense, rank, 2)
    return {"keys": keys, "local": local, "path": str(path), "saved": saved, "next": _tables(dmp),
            "optimizer_keys": sorted(dmp.fused_optimizer.state_dict()["state"])}


def _load_worker(rank: int, world_size: int, path: str):
    dmp, dense = _dmp("table_wise")
    load_checkpoint(path, dmp, dense)
    loaded = _tables(dmp)
    _step(dmp, dense, rank, 2)
    return {"loaded": loaded, "next": _tables(dmp)}


def test_row_wise_checkpoint_loads_table_wise_and_in_one_process(tmp_path):
    saved = run_ranks(_save_worker, 2, str(tmp_path))
    unsharded_keys = set(SeqModel().state_dict())
    assert set(saved[0]["keys"]) == unsharded_keys
    assert saved[0]["keys"]["ec.embeddings.seq.weight"] == ("ShardedTensor", [20, 8])
    assert saved[0]["keys"]["ec.embeddings.hist.weight"] == ("ShardedTensor", [13, 12])
    assert saved[0]["local"] == [([0, 0], [10, 8])] and saved[1]["local"] == [([10, 0], [10, 8])]
    assert saved[0]["optimizer_keys"] == ["ec.embeddings.hist.weight", "ec.embeddings.seq.weight"]
    torch.manual_seed(0)
    initial = SeqModel().ec.embeddings["seq"].weight.detach()
    assert not torch.equal(saved[0]["saved"]["seq"], initial)  # it trained
    loaded = run_ranks(_load_worker, 2, saved[0]["path"])
    for name in ("seq", "hist"):
        assert torch.equal(loaded[0]["loaded"][name], saved[0]["saved"][name])
        # the row-wise adagrad state came along: the next step is the saving run's own
        torch.testing.assert_close(loaded[0]["next"][name], saved[0]["next"][name], atol=1e-6, rtol=0)
    # one process, no process group: the full tables, under the unsharded model's keys
    state = CheckpointReader(saved[0]["path"]).dense_state_dict()
    model = SeqModel()
    model.load_state_dict(state)
    for name in ("seq", "hist"):
        assert torch.equal(model.ec.embeddings[name].weight.detach(), saved[0]["saved"][name])
