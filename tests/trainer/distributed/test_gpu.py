"""GPU paths: NCCL sharding and the CUDA-only fused optimizers (skipped without CUDA)."""

import pytest
import torch

from gloo_ranks import run_ranks
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from recship.trainer.distributed import ShardedEmbeddingBagCollection
from recship.trainer.distributed.types import ShardingEnv
from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
from recship.trainer.planner import EmbeddingShardingPlanner, ParameterConstraints, ShardingType, Topology
from test_sharded_ebc import FORWARD_CASES, LOCAL_BATCH, global_batch, sample_tables

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL, CUDA-only optimizers)")


def _nccl_forward_worker(rank, world_size):
    device = torch.device("cuda", rank)
    errors = {}
    for sharding_type, pooling, weighted in FORWARD_CASES:
        torch.manual_seed(0)
        tables = sample_tables(pooling)
        ebc = EmbeddingBagCollection(tables, is_weighted=weighted)
        constraints = {t.name: ParameterConstraints(sharding_types=[sharding_type]) for t in tables}
        plan = EmbeddingShardingPlanner(Topology(world_size, "cuda"), constraints=constraints).plan(ebc).get_plan_for_module("")
        sharded = ShardedEmbeddingBagCollection(ebc, plan, ShardingEnv.from_process_group(None), fused_params=FusedOptimizerConfig(EmbOptimType.EXACT_SGD), device=device)
        global_kjt, local = global_batch(tables, world_size, seed=1, weighted=weighted)
        want = ebc(global_kjt).values()[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        got = sharded(local[rank].to(device)).values().cpu()
        errors[(sharding_type.value, pooling.value, weighted)] = float((got - want).abs().max().detach())
    return errors


def test_nccl_sharded_forward_equals_unsharded():
    world_size = min(2, torch.cuda.device_count())
    for errors in run_ranks(_nccl_forward_worker, world_size, backend="nccl"):
        assert {k: e for k, e in errors.items() if e > 1e-5} == {}


def _adam_worker(rank, world_size):
    """Every row is looked up in every step, so fbgemm's (sparse) Adam equals torch's dense Adam."""
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="t", num_embeddings=8, embedding_dim=8, feature_names=["f"], pooling=PoolingType.SUM)]
    ebc = EmbeddingBagCollection(tables)
    plan = EmbeddingShardingPlanner(Topology(world_size, "cuda"), constraints={"t": ParameterConstraints([ShardingType.TABLE_WISE])}).plan(ebc)
    sharded = ShardedEmbeddingBagCollection(
        ebc, plan.get_plan_for_module(""), ShardingEnv.from_process_group(None), fused_params=FusedOptimizerConfig(EmbOptimType.ADAM, learning_rate=0.01, eps=1e-8), device=device
    )
    ref = torch.nn.Parameter(ebc.embedding_bags["t"].weight.detach().clone())
    opt = torch.optim.Adam([ref], lr=0.01, eps=1e-8, betas=(0.9, 0.999))
    from recship.sparse import KeyedJaggedTensor

    for step in range(3):
        kjt = KeyedJaggedTensor(keys=["f"], values=torch.arange(8).repeat(world_size), lengths=torch.full((world_size * 2,), 4))
        target = torch.randn(world_size * 2, 8, generator=torch.Generator().manual_seed(step))
        local = KeyedJaggedTensor(keys=["f"], values=torch.arange(8), lengths=torch.full((2,), 4))
        (sharded(local.to(device)).values().cpu() * target[rank * 2 : rank * 2 + 2]).sum().backward()
        pooled = torch.nn.functional.embedding_bag(kjt.values(), ref, kjt.offsets(), mode="sum", include_last_offset=True)
        ((pooled * target).sum() / world_size).backward()
        opt.step()
        opt.zero_grad()
    full = sharded.gather_table("t")
    return None if full is None else float((full - ref.detach()).abs().max())


def test_cuda_only_adam_matches_torch_adam():
    assert run_ranks(_adam_worker, 1, backend="nccl")[0] < 1e-5
