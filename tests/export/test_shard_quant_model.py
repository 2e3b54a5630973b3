"""shard_quant_model: any quantized model's collections over 1, 2, 3 shards answer what the unsharded one answers."""

import pytest
import torch
from torch import nn

from recship.export import shard_quant_model
from recship.quantize.sharded import ShardedQuantEmbeddingBagCollection
from recship.quantize import quantize_embeddings
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

from reference import random_kjt


class Ranker(nn.Module):
    """Two collections: unweighted SUM/MEAN tables (one shared by two features) and a weighted one."""

    def __init__(self):
        super().__init__()
        self.ids = EmbeddingBagCollection([
            EmbeddingBagConfig(name="a", num_embeddings=37, embedding_dim=8, feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="b", num_embeddings=23, embedding_dim=16, feature_names=["f2"], pooling=PoolingType.MEAN),
        ])
        self.scored = nn.ModuleDict({"ebc": EmbeddingBagCollection([
            EmbeddingBagConfig(name="c", num_embeddings=41, embedding_dim=12, feature_names=["w0"], pooling=PoolingType.MEAN),
        ], is_weighted=True)})
        self.head = nn.Linear(8 + 8 + 16 + 12, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.1)

    def forward(self, ids: KeyedJaggedTensor, scored: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(torch.cat([self.ids(ids).values(), self.scored["ebc"](scored).values()], dim=1))


def _inputs(batch, seed):
    return (random_kjt(["f0", "f1", "f2"], batch, seed, max_id=[37, 37, 23])[0],
            random_kjt(["w0"], batch, seed + 1, max_id=41, weighted=True)[0])


@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("sharding,dtype", [("table_wise", "int4"), ("row_wise", "int8"), ("column_wise", "fp16")])
def test_sharded_model_equals_the_unsharded_quantized_model(shards, sharding, dtype):
    torch.manual_seed(shards)
    quantized, _ = quantize_embeddings(Ranker(), dtype=dtype)
    sharded, plans = shard_quant_model(quantized, shards=shards, sharding=sharding)
    assert isinstance(sharded.ids, ShardedQuantEmbeddingBagCollection) and isinstance(sharded.scored["ebc"], ShardedQuantEmbeddingBagCollection)
    placed = {s.device for table_shards in plans["ids"].values() for s in table_shards}
    assert placed == set(range(min(shards, 2 if sharding == "table_wise" else shards)))
    for batch, seed in [(1, 1), (7, 2), (513, 3)]:
        inputs = _inputs(batch, seed)
        with torch.no_grad():
            torch.testing.assert_close(sharded(*inputs), quantized(*inputs), atol=1e-6, rtol=1e-6)


def test_out_of_range_ids_still_fail_after_sharding():
    torch.manual_seed(0)
    sharded, _ = shard_quant_model(quantize_embeddings(Ranker())[0], shards=2, sharding="row_wise")
    ids, scored = _inputs(3, 4)
    bad = KeyedJaggedTensor(keys=ids.keys(), values=torch.cat([ids.values()[:-1], torch.tensor([37])]), lengths=ids.lengths())
    with pytest.raises(ValueError, match=r"feature 'f2': id 37 is out of range \[0, 23\)"):
        sharded(bad, scored)


def test_bad_arguments():
    torch.manual_seed(0)
    quantized, _ = quantize_embeddings(Ranker(), dtype="int8")
    with pytest.raises(ValueError, match="exactly one of"):
        shard_quant_model(quantized)
    with pytest.raises(ValueError, match="quantize it first"):
        shard_quant_model(Ranker(), shards=2)
    with pytest.raises(ValueError, match="cannot be split by columns"):
        shard_quant_model(quantized, shards=2, sharding="column_wise")
    with pytest.raises(ValueError, match="no collection has"):
        shard_quant_model(quantized, shards=2, sharding={"zz": "row_wise"})


def test_the_sharded_model_traces_and_scripts():
    from recship.fx import symbolic_trace

    torch.manual_seed(5)
    sharded, _ = shard_quant_model(quantize_embeddings(Ranker(), dtype="int8")[0], shards=2, sharding={"a": "row_wise"})
    scripted = torch.jit.script(symbolic_trace(sharded))
    inputs = _inputs(9, 6)
    with torch.no_grad():
        assert torch.equal(scripted(*inputs), sharded(*inputs))
