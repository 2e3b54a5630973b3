"""The tutorial's multi-process walk-through: 4 tables sharded over 2 gloo ranks, each sharding type.

Two 'large' 4096 x 64 and two 'small' 1024 x 64 tables. For every sharding type
the planner's plan is printed, then two spawned ranks run the sharded forward on
their halves of a batch and check it against the unsharded module.
"""

import os
import socket
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recship.names import TRAINING_SHARDING_TYPES
from recship.sparse import JaggedTensor, KeyedJaggedTensor
from recship.trainer.distributed import ShardedEmbeddingBagCollection
from recship.trainer.distributed.types import ShardingEnv
from recship.modules.embedding_configs import EmbeddingBagConfig
from recship.modules.embedding_modules import EmbeddingBagCollection
from recship.trainer.fused_optim import FusedOptimizerConfig
from recship.trainer.planner import EmbeddingShardingPlanner, ParameterConstraints, ShardingType, Topology

WORLD_SIZE = 2
TABLES = {"large_table_0": 4096, "large_table_1": 4096, "small_table_0": 1024, "small_table_1": 1024}


def tutorial_ebc(device: Optional[str] = None) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=64, feature_names=[n]) for n, r in TABLES.items()],
        device=device,
    )


def plan_for(sharding_type: ShardingType):
    constraints = {n: ParameterConstraints(sharding_types=[sharding_type]) for n in TABLES}
    return EmbeddingShardingPlanner(Topology(WORLD_SIZE, "cpu"), constraints=constraints).plan(tutorial_ebc("meta"))


def _batch(seed: int, examples: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(TABLES) * examples,), generator=g)
    rows = torch.tensor(list(TABLES.values())).repeat_interleave(examples).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * rows).long()
    return KeyedJaggedTensor(keys=list(TABLES), values=values, lengths=lengths)


def _rank_errors(rank: int) -> dict:
    """Max abs difference between the sharded and the unsharded forward, per sharding type."""
    errors = {}
    for st in TRAINING_SHARDING_TYPES:
        torch.manual_seed(0)
        ebc = tutorial_ebc()
        sharded = ShardedEmbeddingBagCollection(ebc, plan_for(st).get_plan_for_module(""), ShardingEnv.from_process_group(None), fused_params=FusedOptimizerConfig())
        full = _batch(seed=1, examples=2 * WORLD_SIZE)
        local = [KeyedJaggedTensor.from_jt_dict({k: _slice(jt, r) for k, jt in full.to_dict().items()}) for r in range(WORLD_SIZE)]
        want = ebc(full).values()[2 * rank : 2 * rank + 2]
        errors[st.value] = float((sharded(local[rank]).values() - want).abs().max().detach())
    return errors


def _rank_main(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    # the sharded modules (which hold the process group) live only inside _rank_errors, so they are
    # gone before the group is destroyed; the barrier keeps either rank from tearing down while the
    # other still talks (a rank once died in gloo's teardown, SIGABRT, on a CI run)
    queue.put((rank, _rank_errors(rank)))
    dist.barrier()
    dist.destroy_process_group()


def _slice(jt, rank):
    lo, hi = 2 * rank, 2 * rank + 2
    o = jt.offsets()
    return JaggedTensor(values=jt.values()[int(o[lo]) : int(o[hi])], lengths=jt.lengths()[lo:hi])


def run() -> None:
    for st in TRAINING_SHARDING_TYPES:
        print(f"\n-- {st.value} over {WORLD_SIZE} ranks")
        print(plan_for(st))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # mp.spawn re-raises a failed rank's exception here with that rank's traceback (a rank that
    # dies no longer leaves the parent waiting); each rank's few floats fit the pipe's buffer
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_main, args=(port, queue), nprocs=WORLD_SIZE)
    results = dict(queue.get() for _ in range(WORLD_SIZE))
    for st in TRAINING_SHARDING_TYPES:
        worst = max(results[r][st.value] for r in range(WORLD_SIZE))
        if worst > 1e-5:
            raise RuntimeError(f"{st.value}: sharded forward differs from unsharded by {worst}")
        print(f"   ok: {st.value} sharded forward on 2 gloo ranks equals the unsharded EBC (max abs err {worst:.1e})")
