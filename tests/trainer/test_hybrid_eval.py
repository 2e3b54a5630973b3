"""HybridEvalDMP (TorchRec's): no DDP by default, ``to`` moves / casts the dense part only, and
``share_embedding_memory`` really maps rank 0's table memory into the other ranks (a write on rank 0 changes rank 1's
lookups), refusing ranks whose tables differ. Ranks hold the same tables when the plan replicates them
(data_parallel), or when two equal tables go table-wise one to each rank (then rank 1's lookup kernel reads rank 0's
memory); one table table-wise on rank 0 gives the ranks different tables."""

from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gloo_ranks import run_ranks
from recship.distributed import HybridEvalDMP, ShardingPlan, construct_module_sharding_plan, data_parallel, table_wise
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=8, feature_names=["f"])])
        self.out = nn.Linear(4, 2)
        self.register_buffer("scale", torch.ones(2))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.out(self.ebc(kjt).values()) * self.scale


KJT = KeyedJaggedTensor(keys=["f"], values=torch.tensor([0, 3, 3, 7]), lengths=torch.tensor([2, 1, 1], dtype=torch.int))


def _worker(rank: int, world_size: int, same_tables: bool) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = Model()
    placed = data_parallel() if same_tables else table_wise(rank=0)
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, {"t0": placed}, local_size=world_size,
                                                               world_size=world_size, device_type="cpu")})
    dmp = HybridEvalDMP(model, plan=plan, device=torch.device("cpu"))
    result: Dict[str, Any] = {"ddp": isinstance(dmp._dmp_wrapped_module, DistributedDataParallel), "training": dmp.training}
    ebc = dmp.module.ebc
    result["before"] = dmp(KJT).detach().clone()
    try:
        dmp.share_embedding_memory(dist.group.WORLD)
    except ValueError as e:
        result["error"] = str(e)
        return result
    weight = ebc.embedding_bags["t0"].weight
    if rank == 0:
        with torch.no_grad():
            weight[3].fill_(10.0)  # written on rank 0 only
    dist.barrier()
    result["weight"] = weight.detach().clone()
    result["after"] = dmp(KJT).detach().clone()
    dist.barrier()
    # to(): the dense part is cast, the sharded tables are not
    dmp.to(torch.float64)
    result["dtypes"] = (dmp.module.out.weight.dtype, dmp.module.scale.dtype, ebc.embedding_bags["t0"].weight.dtype)
    return result


class Twins(nn.Module):
    """Two equal tables: table-wise one per rank, each rank's lookup kernel holds the same bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=t, embedding_dim=4, num_embeddings=8, feature_names=[f])
                                           for t, f in (("t0", "f0"), ("t1", "f1"))])
        with torch.no_grad():
            self.ebc.embedding_bags["t1"].weight.copy_(self.ebc.embedding_bags["t0"].weight)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(kjt).values()


TWIN_KJT = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([0, 3, 3, 7, 0, 3, 3, 7]),
                             lengths=torch.tensor([2, 1, 1, 2, 1, 1], dtype=torch.int))


def _kernel_worker(rank: int, world_size: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = Twins()
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, {"t0": table_wise(rank=0), "t1": table_wise(rank=1)},
                                                               local_size=world_size, world_size=world_size, device_type="cpu")})
    dmp = HybridEvalDMP(model, plan=plan, device=torch.device("cpu"))
    before = dmp(TWIN_KJT).detach().clone()
    dmp.share_embedding_memory(dist.group.WORLD)
    if rank == 0:
        with torch.no_grad():
            dmp.module.ebc.embedding_bags["t0"].weight[3].fill_(10.0)  # rank 0's t0 shard: a view of its kernel
    dist.barrier()
    return {"before": before, "after": dmp(TWIN_KJT).detach().clone()}


def _all(rank: int, world_size: int) -> Dict[Any, Dict[str, Any]]:
    out: Dict[Any, Dict[str, Any]] = {same: _worker(rank, world_size, same) for same in (False, True)}  # one spawn for all
    out["kernels"] = _kernel_worker(rank, world_size)
    return out


def test_share_embedding_memory_maps_rank0_tables_and_refuses_different_ones():
    runs = run_ranks(_all, 2)
    results = [run[True] for run in runs]
    for r, got in enumerate(results):
        assert got["ddp"] is False and got["training"] is True  # TorchRec's code leaves the flag as it is
        assert torch.equal(got["weight"][3], torch.full((4,), 10.0)), f"rank {r} does not see rank 0's write"
        assert got["dtypes"] == (torch.float64, torch.float64, torch.float32)
    assert torch.equal(results[0]["before"], results[1]["before"])
    assert torch.equal(results[0]["after"], results[1]["after"])  # rank 1's lookup reads the shared rows too
    assert not torch.equal(results[0]["after"], results[0]["before"])
    for run in runs:  # table-wise on rank 0: rank 1 holds no table, so nothing is shared, on either rank
        assert "rank 1 of the group holds other tables" in run[False]["error"]
    for run in runs:  # f1's bags come from rank 1's kernel for t1, which now reads rank 0's t0 memory
        before, after = run["kernels"]["before"], run["kernels"]["after"]
        assert torch.equal(before[:, :4], before[:, 4:]) and torch.equal(after[:, :4], after[:, 4:])
        # bags [0, 3], [3], [7]: row 3 is 10s now, in f0's columns and f1's
        assert torch.equal(after[1], torch.full((8,), 10.0)) and torch.equal(after[2], before[2])
        torch.testing.assert_close(after[0], before[0] - before[1] + 10.0)


def test_init_data_parallel_is_keyword_only():
    with pytest.raises(TypeError):
        HybridEvalDMP(Model(), False)  # init_data_parallel is keyword-only, as TorchRec's
