"""TorchRec user code (tests/snippets/torchrec_sharded_checkpoint.txt, through docs/torchrec.md's import map) on 2 gloo ranks:
a DistributedModelParallel's state_dict read by table name, one fused Adagrad step, and a torch.distributed.checkpoint
save read back into an unsharded EmbeddingBagCollection. Reference: plain PyTorch (F.embedding_bag and
torch.optim.Adagrad on the whole batch, the loss averaged over ranks as TorchRec's gradient division does)."""

import warnings

import torch

from gloo_ranks import run_ranks
from recship.sparse import KeyedJaggedTensor
from tutorials.notebook import run_snippet

ROWS = {"product": 40, "user": 30, "ad": 10}
DIMS = {"product": 8, "user": 8, "ad": 4}
TABLE = {"product": "product_table", "user": "user_table", "ad": "ad_table"}


def _scope():
    scope = run_snippet("torchrec_sharded_checkpoint")
    return scope


def _weights():
    g = torch.Generator().manual_seed(0)
    return {TABLE[f]: torch.rand(ROWS[f], DIMS[f], generator=g) for f in ROWS}


def _batch(rank):
    g = torch.Generator().manual_seed(10 + rank)
    lengths = torch.randint(0, 4, (3 * 4,), generator=g)
    limits = torch.tensor(list(ROWS.values())).repeat_interleave(4).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * limits).long()
    return list(ROWS), values, lengths


def _worker(rank, world_size, path):
    keys, values, lengths = _batch(rank)
    kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _scope()["train_and_save"](rank, world_size, _weights(), kjt, path)


def _reference():
    weights = {k: torch.nn.Parameter(v.clone()) for k, v in _weights().items()}
    opt = torch.optim.Adagrad(list(weights.values()), lr=0.1, eps=1e-8)
    loss = 0
    for rank in range(2):
        keys, values, lengths = _batch(rank)
        offsets = 0
        for i, f in enumerate(keys):
            l = lengths[i * 4 : (i + 1) * 4]
            ids = values[offsets : offsets + int(l.sum())]
            offsets += int(l.sum())
            bag_offsets = torch.cat([torch.zeros(1, dtype=torch.long), l.cumsum(0)[:-1]])
            loss = loss + torch.nn.functional.embedding_bag(ids, weights[TABLE[f]], bag_offsets, mode="sum").sum() / 2
    loss.backward()
    opt.step()
    return {k: w.detach() for k, w in weights.items()}, {k: opt.state[w]["sum"] for k, w in weights.items()}


def test_sharded_state_dict_and_dcp_checkpoint_as_torchrec_users_write_them(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_ranks(_worker, 2, path)
    tables, sums = _reference()
    for r in results:
        assert r["keys"] == [f"embedding_bags.{t}.weight" for t in ("product_table", "user_table", "ad_table")]
        assert r["types"] == ["ShardedTensor"] * 3
    for name, want in tables.items():
        torch.testing.assert_close(results[0]["tables"][f"embedding_bags.{name}.weight"], want, atol=1e-6, rtol=0)
    # the optimizer state, keyed as TorchRec keys it: rank 0 holds no shard of the table-wise ad_table
    assert sorted(results[0]["optim"]) == ["embedding_bags.product_table.weight", "embedding_bags.user_table.weight"]
    for name, want in sums.items():
        got = torch.full_like(want, float("nan"))
        for r in results:
            for offsets, t in r["optim"].get(f"embedding_bags.{name}.weight", {}).get(f"{name}.momentum1", []):
                got[offsets[0] : offsets[0] + t.shape[0], offsets[1] : offsets[1] + t.shape[1]] = t
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unsharded = _scope()["read_unsharded"](path)
    for name in tables:
        assert torch.equal(unsharded.embedding_bags[name].weight.detach(), results[0]["tables"][f"embedding_bags.{name}.weight"])
