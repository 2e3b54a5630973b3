"""A ManagedCollisionEmbeddingCollection under DistributedModelParallel's defaults (planner and default sharders, as
`recship train` shards a model) on 2 gloo ranks: its table is planned row-wise and its managed-collision collection
is sharded with it, so rank r's module remaps the raw ids of input block r ([0, 30) and [30, 60)) into rank r's rows.

The one-process reference remaps the whole batch with one module per block, built with ``rebuild_with_output_id_range``
for that rank's rows; each rank's remapped ids must equal the reference's for its examples, and its looked-up rows
the gathered table's rows at those ids.
"""

from typing import Dict, List

import torch
from torch import nn

from gloo_ranks import gather_whole, run_ranks
from recship.sparse import JaggedTensor, KeyedJaggedTensor
from recship.trainer import EmbeddingCollection, EmbeddingConfig
from recship.trainer.managed_collisions import (LRU_EvictionPolicy, ManagedCollisionCollection, ManagedCollisionEmbeddingCollection,
                                                MCHManagedCollisionModule)
from recship.trainer.model_parallel import DistributedModelParallel

LOCAL_BATCH, STEPS, HASH, ROWS = 4, 3, 60, 12
TABLES = [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=ROWS, feature_names=["a"])]


def _mc_module() -> MCHManagedCollisionModule:
    return MCHManagedCollisionModule(zch_size=ROWS, device=torch.device("cpu"), eviction_policy=LRU_EvictionPolicy(), eviction_interval=1,
                                     input_hash_size=HASH, buckets=2)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mc = ManagedCollisionEmbeddingCollection(EmbeddingCollection(TABLES), ManagedCollisionCollection({"t": _mc_module()}, TABLES),
                                                      return_remapped_features=True)

    def forward(self, kjt: KeyedJaggedTensor):
        return self.mc(kjt)


def _batch(step: int, first: int, count: int) -> KeyedJaggedTensor:
    """Examples [first, first + count) of the step's global batch: 0-4 raw ids in [0, HASH) each."""
    g = torch.Generator().manual_seed(300 + step)
    lengths = torch.randint(0, 5, (2 * LOCAL_BATCH,), generator=g)
    ids = [torch.randint(0, HASH, (int(k),), generator=g) for k in lengths]
    return KeyedJaggedTensor.from_jt_dict({"a": JaggedTensor(values=torch.cat(ids[first: first + count]),
                                                              lengths=lengths[first: first + count])})


def _worker(rank: int, world_size: int) -> Dict[str, object]:
    torch.manual_seed(0)
    dmp = DistributedModelParallel(Model())
    mc = dmp.module.mc
    remapped: List[torch.Tensor] = []
    rows: List[torch.Tensor] = []
    for step in range(STEPS):
        looked_up, ids = dmp(_batch(step, rank * LOCAL_BATCH, LOCAL_BATCH))
        remapped.append(ids.values().clone())
        rows.append(looked_up["a"].values().detach().clone())
    return {"plan": {t: ps.sharding_type.value for t, ps in dmp.plan.get_plan_for_module("mc._embedding_module").items()},
            "kinds": (type(mc._embedding_module).__name__, type(mc._managed_collision_collection).__name__),
            "remapped": remapped, "rows": rows, "table": gather_whole(dmp.state_dict()["mc._embedding_module.embeddings.t.weight"])}


def _reference() -> List[List[torch.Tensor]]:
    """Each rank's remapped ids per step, by the per-block modules of one process."""
    half = ROWS // 2
    blocks = [_mc_module().rebuild_with_output_id_range((r * half, (r + 1) * half), [0, half, ROWS]) for r in range(2)]
    per_rank: List[List[torch.Tensor]] = [[], []]
    for step in range(STEPS):
        kjt = _batch(step, 0, 2 * LOCAL_BATCH)
        ids = kjt.values()
        block = ids // (HASH // 2)
        got = torch.empty_like(ids)
        for r in range(2):
            jt = JaggedTensor(values=ids[block == r], lengths=torch.tensor([int((block == r).sum())]))
            got[block == r] = blocks[r]({"t": jt})["t"].values()
        bags = torch.split(got, kjt.lengths().tolist())
        for r in range(2):
            per_rank[r].append(torch.cat(bags[r * LOCAL_BATCH: (r + 1) * LOCAL_BATCH]))
    return per_rank


def test_dmp_defaults_shard_the_managed_collisions_with_the_collection() -> None:
    want = _reference()
    results = run_ranks(_worker, 2)
    table = results[0]["table"]
    for r, got in enumerate(results):
        assert got["plan"] == {"t": "row_wise"}
        assert got["kinds"] == ("ShardedEmbeddingCollection", "ShardedManagedCollisionCollection")
        for step in range(STEPS):
            assert torch.equal(got["remapped"][step], want[r][step]), f"rank {r} step {step}"
            assert torch.equal(got["rows"][step], table[got["remapped"][step]]), f"rank {r} step {step}"
        for step in range(STEPS):  # each block's raw ids took rows of its rank's shard, whichever rank's example
            raw = _batch(step, r * LOCAL_BATCH, LOCAL_BATCH).values()
            assert torch.equal(raw < HASH // 2, got["remapped"][step] < ROWS // 2), f"rank {r} step {step}"
    assert len(set(torch.cat(want[0] + want[1]).tolist())) > 6  # slots went to many ids
