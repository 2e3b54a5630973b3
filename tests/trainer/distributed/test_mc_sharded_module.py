"""BaseShardedManagedCollisionEmbeddingCollection (TorchRec's constructor: module, plan, e_sharder, mc_sharder, env,
device) on 2 gloo ranks: what ManagedCollisionEmbedding(Bag)CollectionSharder.shard returns. It must answer as the
module DistributedModelParallel shards in place (the tables by their sharder, then shard_managed_collision_collection),
which test_mc_training checks against a one-process reference: same pooled rows, same remapped ids, same state."""

from typing import Dict

import torch

from gloo_ranks import gather_whole, run_ranks
from recship.distributed import (BaseShardedManagedCollisionEmbeddingCollection, ShardedManagedCollisionEmbeddingBagCollection,
                                 ShardingEnv, construct_module_sharding_plan, row_wise)
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.trainer.distributed.mc_sharder import (ManagedCollisionCollectionSharder, ManagedCollisionEmbeddingBagCollectionSharder,
                                                    shard_managed_collision_collection)
from recship.trainer.distributed.sharders import EmbeddingBagCollectionSharder, EmbeddingCollectionSharder
from recship.trainer.managed_collisions import (DistanceLFU_EvictionPolicy, ManagedCollisionCollection,
                                                ManagedCollisionEmbeddingBagCollection, MCHManagedCollisionModule)

HASH = 60
TABLES = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=12, feature_names=["a", "b"]),
          EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=8, feature_names=["c"])]
CPU = torch.device("cpu")


def _model() -> ManagedCollisionEmbeddingBagCollection:
    torch.manual_seed(0)
    modules = {t.name: MCHManagedCollisionModule(zch_size=t.num_embeddings, device=CPU, eviction_policy=DistanceLFU_EvictionPolicy(),
                                                 eviction_interval=1, input_hash_size=HASH, buckets=2) for t in TABLES}
    return ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(TABLES), ManagedCollisionCollection(modules, TABLES),  # type: ignore[arg-type]
                                                  return_remapped_features=True)


def _batch(step: int, rank: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 4, (3 * 4,), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=["a", "b", "c"], values=torch.randint(0, HASH, (int(lengths.sum()),), generator=g),
                                               lengths=lengths)


def _worker(rank: int, world_size: int) -> Dict[str, object]:
    env = ShardingEnv.from_process_group(None)
    plan = construct_module_sharding_plan(_model(), {"t0": row_wise(), "t1": row_wise()}, local_size=world_size,
                                          world_size=world_size, device_type="cpu")
    ebc_sharder = EmbeddingBagCollectionSharder()
    built = BaseShardedManagedCollisionEmbeddingCollection(_model(), plan, ebc_sharder, ManagedCollisionCollectionSharder(), env, CPU)
    via_sharder = ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder).shard(_model(), plan, env, CPU)
    in_place = _model()
    in_place._embedding_module = ebc_sharder.shard(in_place._embedding_module, plan, env, CPU)
    shard_managed_collision_collection(in_place, plan, env, CPU)
    out: Dict[str, object] = {"type": type(via_sharder).__name__, "same": True}
    for step in range(3):  # training mode: each step profiles, evicts and remaps
        kjt = _batch(step, rank)
        (a, a_ids), (b, b_ids), (c, c_ids) = built(kjt), via_sharder(kjt), in_place(kjt)
        out["same"] = bool(out["same"]) and all(torch.equal(x.values(), c.values()) for x in (a, b)) and all(
            torch.equal(x.values(), c_ids.values()) for x in (a_ids, b_ids))
    state, want = built.state_dict(), in_place.state_dict()
    out["keys_same"] = list(state) == list(want)
    same = True
    for k in want:  # gathering a ShardedTensor is a collective: every rank gathers every key
        got, expected = gather_whole(state[k]), gather_whole(want[k])
        same = same and (rank != 0 or torch.equal(got, expected))
    out["state_same"] = same
    try:
        BaseShardedManagedCollisionEmbeddingCollection(_model(), plan, EmbeddingCollectionSharder(), ManagedCollisionCollectionSharder(), env, CPU)
        out["refused"] = ""
    except TypeError as e:
        out["refused"] = str(e)
    return out


def test_base_sharded_module_answers_as_dmp_in_place() -> None:
    for r in run_ranks(_worker, 2):
        assert r["type"] == ShardedManagedCollisionEmbeddingBagCollection.__name__
        assert r["same"] and r["keys_same"] and r["state_same"]
        assert "EmbeddingBagCollectionSharder" in str(r["refused"])
