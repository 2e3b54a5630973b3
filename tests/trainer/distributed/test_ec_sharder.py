"""EmbeddingCollectionSharder, get_default_sharders and ParameterSharding.sharding_spec as TorchRec users write them
(tests/snippets/torchrec_ec_sharding.txt through docs/torchrec.md's import map): an EmbeddingCollection's tables are planned
like TorchRec 1.8.0 plans them on CPU (the snippet's "seq": row_wise, fused), table_row_wise (which TorchRec's
EmbeddingCollectionSharder lacks) is an error naming table and type, an all-data-parallel plan leaves the collection
as it is, and sharding_spec is torch's EnumerableShardingSpec of the shards as TorchRec documents it (None for
data-parallel)."""


import pytest
import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

from recship.trainer.distributed.types import ShardingEnv
from tutorials.notebook import run_snippet



@pytest.fixture(scope="module")
def user():
    return run_snippet("torchrec_ec_sharding", forbid_torchrec=True)


def test_default_sharders_are_torchrecs_and_the_ec_is_planned_as_torchrec_plans_it(user):
    sharders = user["get_default_sharders"]()
    assert [type(s).__name__ for s in sharders] == ["EmbeddingBagCollectionSharder", "EmbeddingCollectionSharder"]
    assert [s.module_type for s in sharders] == [user["EmbeddingBagCollection"], user["EmbeddingCollection"]]
    assert sharders[1].sharding_types("cpu") == ["data_parallel", "table_wise", "column_wise", "row_wise"]
    model = user["TwoTowers"](torch.device("meta"))
    plan = user["plan_for"](model, 2)
    seq = plan.get_plan_for_module("ec")["seq"]
    assert (seq.sharding_type, seq.compute_kernel, seq.ranks) == ("row_wise", "fused", [0, 1])  # TorchRec 1.8.0's choice
    assert [(s.shard_offsets, s.shard_sizes) for s in seq.shards] == [([0, 0], [6, 8]), ([6, 0], [6, 8])]
    # the EBC is planned as with its sharder alone; without the EC sharder the EC is not planned
    alone = user["plan_for"](model, 2, sharders=[user["EmbeddingBagCollectionSharder"]()])
    assert alone.get_plan_for_module("ebc") == plan.get_plan_for_module("ebc") and alone.get_plan_for_module("ec") is None
    replicas = user["plan_for"](model, 2, {"seq": user["ParameterConstraints"](sharding_types=["data_parallel"])})
    seq = replicas.get_plan_for_module("ec")["seq"]
    assert (seq.sharding_type, seq.compute_kernel, seq.ranks) == ("data_parallel", "dense", [0, 1])
    assert [(s.shard_offsets, s.shard_sizes) for s in seq.shards] == [([0, 0], [12, 8])] * 2
    assert seq.sharding_spec is None  # TorchRec: replicas have no sharding spec


def test_table_row_wise_for_an_ec_table_is_an_error_naming_it(user):
    model = user["TwoTowers"](torch.device("meta"))
    with pytest.raises(ValueError, match=r"'seq'.*\['table_row_wise'\].*no table_row_wise"):
        user["plan_for"](model, 2, {"seq": user["ParameterConstraints"](sharding_types=["table_row_wise"])})
    sharder, env = user["EmbeddingCollectionSharder"](), ShardingEnv(world_size=2, rank=0, pg=None)
    ec = user["TwoTowers"](torch.device("cpu")).ec
    with pytest.raises(ValueError, match=r"table 'seq' of an EmbeddingCollection is planned 'table_row_wise'"):
        sharder.shard(ec, user["hand_plan"](ec, user["table_row_wise"](host_index=0), 2), env)
    assert sharder.shard(ec, user["hand_plan"](ec, user["data_parallel"](), 2), env) is ec  # replicas: DDP trains it whole
    with pytest.raises(ValueError, match=r"lacks its tables \['seq'\]"):
        sharder.shard(ec, {}, env)
    with pytest.raises(TypeError, match="shards EmbeddingCollection"):
        sharder.shard(user["TwoTowers"](torch.device("cpu")).ebc, {}, env)


def test_sharding_spec_is_torchs_enumerable_spec_of_the_shards(user):
    model = user["TwoTowers"](torch.device("meta"))
    plan = user["construct_module_sharding_plan"](model.ebc, {"bag": user["row_wise"]()}, local_size=2, world_size=2,
                                                  device_type="cpu")
    # TorchRec's documented layout of a 10-row table split over 2 ranks: ceil(10 / 2) rows each
    want = EnumerableShardingSpec([ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 8], placement="rank:0/cpu"),
                                   ShardMetadata(shard_offsets=[5, 0], shard_sizes=[5, 8], placement="rank:1/cpu")])
    assert plan["bag"].sharding_spec == want
    tw = user["construct_module_sharding_plan"](model.ebc, {"bag": user["table_wise"](rank=1)}, local_size=2, world_size=2,
                                                device_type="cpu")
    assert tw["bag"].sharding_spec == EnumerableShardingSpec(
        [ShardMetadata(shard_offsets=[0, 0], shard_sizes=[10, 8], placement="rank:1/cpu")])


def test_dmp_shards_an_ec_table_a_hand_written_plan_puts_table_wise(user, pg):
    """DistributedModelParallel with TorchRec's default sharders and a plan putting the EC's table table_wise on one
    rank: a ShardedEmbeddingCollection whose rows are the unsharded collection's."""
    from recship.sparse import KeyedJaggedTensor
    from recship.trainer.distributed.sharded_ec import ShardedEmbeddingCollection
    from recship.trainer.model_parallel import DistributedModelParallel
    from recship.trainer.planner import ShardingPlan

    model = user["TwoTowers"](torch.device("cpu"))
    unsharded = {n: p.detach().clone() for n, p in model.ec.state_dict().items()}
    plan = ShardingPlan({"ebc": user["construct_module_sharding_plan"](model.ebc, {"bag": user["table_wise"](rank=0)}, local_size=1,
                                                                      world_size=1, device_type="cpu"),
                         "ec": user["hand_plan"](model.ec, user["table_wise"](rank=0), 1)})
    kjt = KeyedJaggedTensor(keys=["f_seq"], values=torch.tensor([3, 11, 0, 5]), lengths=torch.tensor([2, 0, 2]))
    dmp = DistributedModelParallel(model, plan=plan, device=torch.device("cpu"))
    assert isinstance(dmp.module.ec, ShardedEmbeddingCollection)
    rows = dmp.module.ec(kjt)["f_seq"]
    assert torch.equal(rows.values(), unsharded["embeddings.seq.weight"][kjt.values()])
    assert torch.equal(rows.lengths(), kjt.lengths())
