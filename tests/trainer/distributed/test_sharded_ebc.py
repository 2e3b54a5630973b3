"""Sharded EmbeddingBagCollection on gloo vs the unsharded float module and plain-PyTorch optimizers."""

import itertools

import pytest
import torch

from gloo_ranks import run_ranks
from recship.names import TRAINING_SHARDING_TYPES
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from recship.trainer.distributed import ShardedEmbeddingBagCollection
from recship.trainer.distributed.types import ShardingEnv
from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
from recship.trainer.planner import EmbeddingShardingPlanner, ParameterConstraints, ShardingType, Topology

LOCAL_BATCH = 3
TYPES = list(TRAINING_SHARDING_TYPES)
FORWARD_CASES = list(itertools.product(TYPES, [PoolingType.SUM, PoolingType.MEAN], [False, True]))
CPU_OPTIMIZERS = [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD]
OPTIM_CASES = list(itertools.product([t for t in TYPES if t != ShardingType.DATA_PARALLEL], CPU_OPTIMIZERS))


def sample_tables(pooling):
    # uneven row counts; dims multiples of 4 so every table can go column-wise; t3 shares f2 with t1 (TorchRec's shared
    # feature: outputs f2@t1 and f2@t3, ids below both tables' rows)
    return [
        EmbeddingBagConfig(name="t0", num_embeddings=13, embedding_dim=8, feature_names=["f0", "f1"], pooling=pooling),
        EmbeddingBagConfig(name="t1", num_embeddings=20, embedding_dim=12, feature_names=["f2"], pooling=pooling),
        EmbeddingBagConfig(name="t2", num_embeddings=7, embedding_dim=16, feature_names=["f3"], pooling=pooling),
        EmbeddingBagConfig(name="t3", num_embeddings=9, embedding_dim=4, feature_names=["f2"], pooling=pooling),
    ]


def global_batch(tables, world_size, seed, weighted):
    """A random KJT of world_size * LOCAL_BATCH examples, and each rank's slice of it."""
    g = torch.Generator().manual_seed(seed)
    keys = list(dict.fromkeys(f for t in tables for f in t.feature_names))
    rows = {f: min(t.num_embeddings for t in tables if f in t.feature_names) for f in keys}
    batch = world_size * LOCAL_BATCH
    per_key = {}
    for k in keys:
        lengths = torch.randint(0, 4, (batch,), generator=g)
        ids = torch.randint(0, rows[k], (int(lengths.sum()),), generator=g)
        w = torch.rand(ids.numel(), generator=g)
        per_key[k] = (lengths, ids, w)

    def build(lo, hi):
        lengths, values, weights = [], [], []
        for k in keys:
            l, i, w = per_key[k]
            start = int(l[:lo].sum())
            end = int(l[:hi].sum())
            lengths.append(l[lo:hi])
            values.append(i[start:end])
            weights.append(w[start:end])
        return KeyedJaggedTensor(
            keys=keys,
            values=torch.cat(values),
            lengths=torch.cat(lengths),
            weights=torch.cat(weights) if weighted else None,
        )

    return build(0, batch), [build(r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH) for r in range(world_size)]


def _plan(ebc, world_size, sharding_type, local_world_size=None):
    topology = Topology(world_size=world_size, compute_device="cpu", local_world_size=local_world_size)
    constraints = {t.name: ParameterConstraints(sharding_types=[sharding_type]) for t in ebc.embedding_bag_configs()}
    return EmbeddingShardingPlanner(topology, constraints=constraints).plan(ebc).get_plan_for_module("")


def _forward_worker(rank, world_size, local_world_size):
    errors = {}
    for sharding_type, pooling, weighted in FORWARD_CASES:
        torch.manual_seed(0)
        tables = sample_tables(pooling)
        ebc = EmbeddingBagCollection(tables, is_weighted=weighted)
        plan = _plan(ebc, world_size, sharding_type, local_world_size)
        sharded = ShardedEmbeddingBagCollection(ebc, plan, ShardingEnv.from_process_group(None), fused_params=FusedOptimizerConfig(EmbOptimType.EXACT_SGD))
        global_kjt, local = global_batch(tables, world_size, seed=1, weighted=weighted)
        want = ebc(global_kjt).values()[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        got = sharded(local[rank])
        assert got.keys() == ebc(global_kjt).keys()
        errors[(sharding_type.value, pooling.value, weighted)] = float((got.values() - want).abs().max().detach())
    return errors


def _reference_step(weights, grads, states, optim, lr, eps, col_blocks):
    """Plain-PyTorch optimizer updates (the formulas fbgemm's exact optimizers implement).

    Row-wise adagrad keeps one state per row of each column shard: under column-wise
    sharding the mean of g^2 is taken over the shard's columns (as in TorchRec).
    """
    for name, w in weights.items():
        g = grads[name]
        if optim == EmbOptimType.EXACT_SGD:
            w -= lr * g
        elif optim == EmbOptimType.EXACT_ADAGRAD:
            states[name] += g * g
            w -= lr * g / (states[name].sqrt() + eps)
        else:
            for k, (c0, width) in enumerate(col_blocks[name]):
                gb = g[:, c0 : c0 + width]
                states[name][:, k] += (gb * gb).mean(dim=1)
                w[:, c0 : c0 + width] -= lr * gb / (states[name][:, k].sqrt() + eps).unsqueeze(1)


def _optimizer_worker(rank, world_size, local_world_size, only=None):
    errors = {}
    lr, eps = 0.1, 1e-8
    for sharding_type, optim in OPTIM_CASES:
        if only is not None and sharding_type not in only:
            continue
        torch.manual_seed(0)
        tables = sample_tables(PoolingType.MEAN)
        ebc = EmbeddingBagCollection(tables, is_weighted=True)
        plan = _plan(ebc, world_size, sharding_type, local_world_size)
        sharded = ShardedEmbeddingBagCollection(ebc, plan, ShardingEnv.from_process_group(None), fused_params=FusedOptimizerConfig(optim, learning_rate=lr, eps=eps))
        weights = {t.name: ebc.embedding_bags[t.name].weight.detach().clone() for t in tables}
        col_blocks = {n: sorted({(s.shard_offsets[1], s.shard_sizes[1]) for s in ps.shards}) for n, ps in plan.items()}
        states = {
            t.name: torch.zeros(t.num_embeddings, len(col_blocks[t.name]))
            if optim == EmbOptimType.EXACT_ROWWISE_ADAGRAD
            else torch.zeros(t.num_embeddings, t.embedding_dim)
            for t in tables
        }
        for step in range(3):
            if step == 2:
                lr = 0.05  # changing the learning rate between steps
                sharded.set_learning_rate(lr)
            global_kjt, local = global_batch(tables, world_size, seed=10 + step, weighted=True)
            target = torch.randn(world_size * LOCAL_BATCH, sum(len(t.feature_names) * t.embedding_dim for t in tables), generator=torch.Generator().manual_seed(step))
            (sharded(local[rank]).values() * target[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]).sum().backward()
            # reference: one process, global batch, the mean over ranks of the per-rank losses
            ref = EmbeddingBagCollection(tables, is_weighted=True)
            ref.load_state_dict({f"embedding_bags.{n}.weight": w for n, w in weights.items()})
            ((ref(global_kjt).values() * target).sum() / world_size).backward()
            grads = {n: ref.embedding_bags[n].weight.grad for n in weights}
            _reference_step(weights, grads, states, optim, lr, eps, col_blocks)
        lr = 0.1
        for name, w in weights.items():
            full = sharded.gather_table(name)
            if rank == 0:
                errors[(sharding_type.value, optim.value, name)] = float((full - w).abs().max())
    return errors


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def world_size(request):
    return request.param


def test_sharded_forward_equals_unsharded(world_size):
    results = run_ranks(_forward_worker, world_size, None)
    for rank, errors in enumerate(results):
        assert set(errors) == {(t.value, p.value, w) for t, p, w in FORWARD_CASES}
        bad = {k: e for k, e in errors.items() if e > 1e-5}
        assert bad == {}, f"rank {rank}: {bad}"


def test_table_row_wise_on_two_hosts_of_two():
    results = run_ranks(_forward_worker, 4, 2, local_world_size=2)
    for rank, errors in enumerate(results):
        bad = {k: e for k, e in errors.items() if e > 1e-5}
        assert bad == {}, f"rank {rank}: {bad}"
    errors = run_ranks(_optimizer_worker, 4, 2, [ShardingType.TABLE_ROW_WISE], local_world_size=2)[0]
    assert len(errors) == len(CPU_OPTIMIZERS) * len(sample_tables(PoolingType.SUM))
    assert {k: e for k, e in errors.items() if e > 1e-5} == {}


def test_fused_optimizers_equal_plain_pytorch(world_size):
    errors = run_ranks(_optimizer_worker, world_size, None)[0]
    assert len(errors) == len(OPTIM_CASES) * len(sample_tables(PoolingType.SUM))
    bad = {k: e for k, e in errors.items() if e > 1e-5}
    assert bad == {}, bad


def test_gpu_only_optimizer_is_refused_on_cpu():
    with pytest.raises(ValueError, match="ADAM runs on CUDA only"):
        FusedOptimizerConfig(EmbOptimType.ADAM).check_device("cpu")


def test_weight_decay_is_refused_on_cpu_where_fbgemm_ignores_it():
    with pytest.raises(ValueError, match="not applied by fbgemm's CPU kernels"):
        FusedOptimizerConfig(EmbOptimType.EXACT_ADAGRAD, weight_decay=0.01).check_device("cpu")
    FusedOptimizerConfig(EmbOptimType.EXACT_ADAGRAD, weight_decay=0.01).check_device("cuda")


def _freed_worker(rank, world_size):
    import gc
    import weakref

    gc.disable()  # only reference counting: a cycle would keep the module (and the process group it holds) alive
    try:
        tables = sample_tables(PoolingType.MEAN)
        ebc = EmbeddingBagCollection(tables, is_weighted=True)
        sharded = ShardedEmbeddingBagCollection(ebc, _plan(ebc, world_size, ShardingType.ROW_WISE, world_size),
                                                ShardingEnv.from_process_group(None), fused_params=FusedOptimizerConfig(EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1))
        _, local = global_batch(tables, world_size, seed=1, weighted=True)
        sharded(local[rank]).values().sum().backward()
        sharded.fused_optimizer.param_groups[0]["lr"] = 0.05
        sharded.fused_optimizer.step()
        gone = weakref.ref(sharded)
        del sharded
        return gone() is None
    finally:
        gc.enable()


def test_a_sharded_collection_is_freed_when_unreferenced():
    """No reference cycle through its fused optimizer: ranks whose sharded modules outlived destroy_process_group
    kept gloo's threads running into interpreter exit, where freeing a collective's tensors aborted them (SIGABRT)."""
    assert run_ranks(_freed_worker, 2) == [True, True]
