"""A sharded EmbeddingCollection (table-wise, row-wise, column-wise, and row-wise beside a data-parallel table) under
DistributedModelParallel on 2 gloo ranks: its forward returns the unsharded collection's JaggedTensors bit for bit, and
3 training steps with each CPU fused optimizer give the losses and weights of one process training the whole batches
with plain-PyTorch updates (the formulas fbgemm's exact optimizers implement). Batches have variable lengths and empty
bags; two features share a table; the table of width 12 splits column-wise into blocks of 8 and 4 (two TBE widths)."""

import pytest
import torch
from torch import nn

from gloo_ranks import run_ranks
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingCollection, EmbeddingConfig
from recship.trainer.distributed.sharded_ec import EmbeddingCollectionAwaitable, ShardedEmbeddingCollection
from recship.trainer.distributed.sharders import EmbeddingCollectionSharder
from recship.trainer.fused_optim import EmbOptimType
from recship.trainer.model_parallel import DistributedModelParallel
from recship.trainer.planner import ShardingPlan
from recship.trainer.planner.sharding_plan import column_wise, construct_module_sharding_plan, data_parallel, row_wise, table_wise

LOCAL_BATCH, LR, EPS, STEPS = 3, 0.1, 1e-8, 3
FEATURES = ["s1", "s2", "h"]
OPTIMIZERS = [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD]
CASES = {
    "table_wise": {"seq": table_wise(rank=0), "hist": table_wise(rank=1)},
    "row_wise": {"seq": row_wise(), "hist": row_wise()},
    "column_wise": {"seq": column_wise(ranks=[0, 1]), "hist": column_wise(ranks=[1, 0])},
    "mixed": {"seq": row_wise(), "hist": data_parallel()},
}


def tables():
    return [EmbeddingConfig(name="seq", num_embeddings=20, embedding_dim=8, feature_names=["s1", "s2"]),
            EmbeddingConfig(name="hist", num_embeddings=13, embedding_dim=12, feature_names=["h"])]


class SeqModel(nn.Module):
    """Each feature's rows weighted by their position in the bag (the order of rows matters), summed per example."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables())
        self.out = nn.Linear(28, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        jts = self.ec(kjt)
        pooled = []
        for f in FEATURES:
            jt = jts[f]
            lengths = jt.lengths().long()
            example = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
            position = torch.arange(example.numel()) - jt.offsets().long()[:-1].repeat_interleave(lengths)
            rows = jt.values() * (1.0 + 0.1 * position).unsqueeze(1)
            pooled.append(torch.zeros(lengths.numel(), rows.shape[1]).index_add(0, example, rows))
        return self.out(torch.cat(pooled, dim=1))


def batch(step: int, first: int, count: int):
    """Examples [first, first + count) of step ``step``'s global batch: 0-4 ids per bag, and its targets."""
    g = torch.Generator().manual_seed(100 + step)
    n = 2 * LOCAL_BATCH
    lengths = torch.randint(0, 5, (3, n), generator=g)
    lengths[0, 1] = 0  # an empty bag on rank 0 at every step
    rows = [20, 20, 13]
    ids = [[torch.randint(0, rows[f], (int(k),), generator=g) for k in lengths[f]] for f in range(3)]
    target = torch.randn(n, 1, generator=g)
    pick = slice(first, first + count)
    values = torch.cat([torch.cat(ids[f][pick]) for f in range(3)])
    kjt = KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths[:, pick].reshape(-1).int())
    return kjt, target[pick]


def plan_for(model: SeqModel, case: str) -> ShardingPlan:
    return ShardingPlan({"ec": construct_module_sharding_plan(model.ec, CASES[case], local_size=2, world_size=2, device_type="cpu")})


def _worker(rank: int, world_size: int, case: str):
    out = {}
    for optim in OPTIMIZERS:
        torch.manual_seed(0)
        model = SeqModel()
        sharder = EmbeddingCollectionSharder(fused_params={"optimizer": optim, "learning_rate": LR, "eps": EPS})
        dmp = DistributedModelParallel(model, plan=plan_for(model, case), sharders=[sharder])
        dense = torch.optim.SGD(dmp.dense_parameters(), lr=LR)
        ec = dmp.module.ec
        losses, first = [], None
        for step in range(STEPS):
            kjt, target = batch(step, rank * LOCAL_BATCH, LOCAL_BATCH)
            if step == 0:
                got = ec(kjt)
                first = {"awaitable": type(got).__name__,
                         "rows": {f: (jt.values().detach().clone(), jt.lengths(), jt.offsets()) for f, jt in got.wait().items()}}
            loss = nn.functional.mse_loss(dmp(kjt), target)
            loss.backward()
            dense.step()
            dense.zero_grad()
            losses.append(float(loss.detach()))
        state = dmp.state_dict()
        out[optim.name] = {
            "type": type(ec).__name__, "first": first, "losses": losses,
            "tables": {t: ec.gather_table(t) for t in ("seq", "hist")},
            "out": dmp.module.out.weight.detach().clone(),
            "state_types": {k: type(v).__name__ for k, v in state.items()},
        }
    return out


def _reference(optim: EmbOptimType, col_blocks):
    """One process, the whole batches, the mean loss; tables updated by the exact optimizers' formulas."""
    torch.manual_seed(0)
    model = SeqModel()
    first = {f: (jt.values().detach().clone(), jt.lengths(), jt.offsets()) for f, jt in model.ec(batch(0, 0, 2 * LOCAL_BATCH)[0]).items()}
    weights = {n: model.ec.embeddings[n].weight for n in ("seq", "hist")}
    states = {n: torch.zeros(w.shape[0], len(col_blocks[n] or [0]) if optim == EmbOptimType.EXACT_ROWWISE_ADAGRAD else w.shape[1])
              for n, w in weights.items()}
    dense = torch.optim.SGD(model.out.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        kjt, target = batch(step, 0, 2 * LOCAL_BATCH)
        loss = nn.functional.mse_loss(model(kjt), target)
        loss.backward()
        losses.append(float(loss.detach()))
        dense.step()
        dense.zero_grad()
        with torch.no_grad():
            for name, w in weights.items():
                g = w.grad
                if col_blocks[name] is None:  # data-parallel: the dense optimizer's (SGD)
                    w -= LR * g
                elif optim == EmbOptimType.EXACT_SGD:
                    w -= LR * g
                elif optim == EmbOptimType.EXACT_ADAGRAD:
                    states[name] += g * g
                    w -= LR * g / (states[name].sqrt() + EPS)
                else:
                    for k, (c0, width) in enumerate(col_blocks[name]):
                        gb = g[:, c0 : c0 + width]
                        states[name][:, k] += (gb * gb).mean(dim=1)
                        w[:, c0 : c0 + width] -= LR * gb / (states[name][:, k].sqrt() + EPS).unsqueeze(1)
                w.grad = None
    return {"first": first, "losses": losses, "tables": {n: w.detach() for n, w in weights.items()},
            "out": model.out.weight.detach()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_ec_equals_unsharded_and_trains_like_one_process(case):
    results = run_ranks(_worker, 2, case)
    plan = plan_for(SeqModel(), case).get_plan_for_module("ec")
    col_blocks = {n: None if ps.sharding_type == "data_parallel" else sorted({(s.shard_offsets[1], s.shard_sizes[1]) for s in ps.shards})
                  for n, ps in plan.items()}
    for optim in OPTIMIZERS:
        ref = _reference(optim, col_blocks)
        torch.manual_seed(0)
        untrained = SeqModel().ec.embeddings["seq"].weight.detach()
        assert not torch.equal(ref["tables"]["seq"], untrained)  # the reference trained
        for rank, r in enumerate(results):
            got = r[optim.name]
            assert got["type"] == "ShardedEmbeddingCollection" and got["first"]["awaitable"] == "EmbeddingCollectionAwaitable"
            # forward: the rows of the unsharded collection, bit for bit, for this rank's examples
            assert list(got["first"]["rows"]) == FEATURES
            for f, (values, lengths, offsets) in got["first"]["rows"].items():
                want_values, want_lengths, want_offsets = ref["first"][f]
                lo, hi = int(want_offsets[rank * LOCAL_BATCH]), int(want_offsets[(rank + 1) * LOCAL_BATCH])
                assert torch.equal(values, want_values[lo:hi]), (case, optim, f)
                assert torch.equal(lengths.long(), want_lengths[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH].long())
            assert got["state_types"]["ec.embeddings.seq.weight"] == "ShardedTensor"
            assert got["state_types"]["ec.embeddings.hist.weight"] == ("Tensor" if case == "mixed" else "ShardedTensor")
            torch.testing.assert_close(got["out"], ref["out"], atol=1e-6, rtol=0)
        # the ranks' mean losses average to the whole batch's mean loss
        mean = [(a + b) / 2 for a, b in zip(results[0][optim.name]["losses"], results[1][optim.name]["losses"])]
        torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref["losses"]), atol=1e-6, rtol=1e-6)
        for name in ("seq", "hist"):
            torch.testing.assert_close(results[0][optim.name]["tables"][name], ref["tables"][name], atol=1e-6, rtol=0)


def test_table_row_wise_is_refused_for_an_ec_table_as_torchrec_has_no_such_sharding():
    sharder = EmbeddingCollectionSharder()
    assert sharder.sharding_types("cpu") == ["data_parallel", "table_wise", "column_wise", "row_wise"]
    from recship.trainer.distributed.types import ShardingEnv
    from recship.trainer.planner.sharding_plan import table_row_wise

    model = SeqModel()
    plan = construct_module_sharding_plan(model.ec, {"seq": table_row_wise(host_index=0), "hist": table_wise(rank=0)},
                                          local_size=2, world_size=2, device_type="cpu")
    with pytest.raises(ValueError, match=r"table 'seq' of an EmbeddingCollection is planned 'table_row_wise'"):
        ShardedEmbeddingCollection(model.ec, plan, ShardingEnv(2, 0, None))
    assert EmbeddingCollectionAwaitable.__mro__[1].__name__ == "LazyAwaitable"
