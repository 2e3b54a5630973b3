"""An EmbeddingCollection trains data-parallel under DistributedModelParallel on 2 gloo ranks, planned by the planner
with TorchRec's default sharders (EBC sharded, EC replicated as its constraints ask): weights after 3 steps equal one process training the
same model on the whole batches with plain torch SGD."""

import torch
from torch import nn

from gloo_ranks import run_ranks
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from recship.trainer.distributed.sharders import get_default_sharders
from recship.trainer.fused_optim import EmbOptimType
from recship.trainer.model_parallel import DistributedModelParallel
from recship.trainer.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

LOCAL_BATCH, LR, DIM = 3, 0.1, 4


class TwoTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="bag", num_embeddings=7, embedding_dim=DIM, feature_names=["a"])])
        self.ec = EmbeddingCollection([EmbeddingConfig(name="seq", num_embeddings=9, embedding_dim=DIM, feature_names=["s"])])
        self.out = nn.Linear(2 * DIM, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(kjt).values()
        jt = self.ec(kjt)["s"]
        example = torch.repeat_interleave(torch.arange(pooled.shape[0]), jt.lengths().long())
        summed = torch.zeros(pooled.shape[0], DIM).index_add(0, example, jt.values())
        return self.out(torch.cat([pooled, summed], dim=1))


def _batch(step: int, first: int, count: int, world_size: int):
    """Examples [first, first + count) of step ``step``'s global batch (ids and targets drawn for all of it)."""
    g = torch.Generator().manual_seed(step)
    n = world_size * LOCAL_BATCH
    lengths = torch.randint(1, 4, (2, n), generator=g)
    ids = [[torch.randint(0, rows, (int(k),), generator=g) for k in lengths[f]] for f, rows in ((0, 7), (1, 9))]
    target = torch.randn(n, 1, generator=g)
    pick = slice(first, first + count)
    values = torch.cat([torch.cat(ids[0][pick]), torch.cat(ids[1][pick])])
    kjt = KeyedJaggedTensor(keys=["a", "s"], values=values, lengths=torch.cat([lengths[0][pick], lengths[1][pick]]).int())
    return kjt, target[pick]


def _worker(rank: int, world_size: int, steps: int):
    torch.manual_seed(0)
    model = TwoTowers()
    sharders = get_default_sharders()
    replicas = {"seq": ParameterConstraints(sharding_types=["data_parallel"])}  # test_ec_sharding.py: sharded EC tables
    plan = EmbeddingShardingPlanner(Topology(world_size, "cpu"), constraints=replicas, debug=False).collective_plan(model, sharders)
    dmp = DistributedModelParallel(model, plan=plan, sharders=[type(sharders[0])(fused_params={"optimizer": EmbOptimType.EXACT_SGD,
                                                                                             "learning_rate": LR}), sharders[1]])
    dense = torch.optim.SGD(dmp.dense_parameters(), lr=LR)
    for step in range(steps):
        kjt, target = _batch(step, rank * LOCAL_BATCH, LOCAL_BATCH, world_size)
        nn.functional.mse_loss(dmp(kjt), target).backward()
        dense.step()
        dense.zero_grad()
    sharded = dmp.sharded_modules()[0]
    return {"plan": {n: ps.sharding_type.value for n, ps in plan.get_plan_for_module("ec").items()},
            "bag": sharded.gather_table("bag"), "seq": dmp.unwrapped.ec.embeddings["seq"].weight.detach().clone(),
            "out": dmp.unwrapped.out.weight.detach().clone()}


def test_an_embedding_collection_trains_data_parallel_like_one_process():
    world_size, steps = 2, 3
    results = run_ranks(_worker, world_size, steps)
    torch.manual_seed(0)
    reference = TwoTowers()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(steps):
        kjt, target = _batch(step, 0, world_size * LOCAL_BATCH, world_size)
        nn.functional.mse_loss(reference(kjt), target).backward()
        opt.step()
        opt.zero_grad()
    assert results[0]["plan"] == {"seq": "data_parallel"}
    seq = reference.ec.embeddings["seq"].weight.detach()
    torch.manual_seed(0)
    assert not torch.equal(seq, TwoTowers().ec.embeddings["seq"].weight.detach())  # it trained
    for r in results:
        torch.testing.assert_close(r["seq"], seq, atol=1e-6, rtol=0)
        torch.testing.assert_close(r["out"], reference.out.weight.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(results[0]["bag"], reference.ebc.embedding_bags["bag"].weight.detach(), atol=1e-6, rtol=0)
