"""TorchRec's weight round trip on an inference-sharded model: ``get_table_to_weights_from_tbe`` on the quantized model,
``assign_weights_to_tbe`` on the sharded one (table-wise blocks take their table's rows; a row block is refused), and
the sharded collection's ``tbes``; checked against the unsharded quantized model's outputs."""

import pytest
import torch

from recship import EmbeddingBagCollection, EmbeddingBagConfig
from recship.distributed import ShardingEnv, _shard_modules, construct_module_sharding_plan, row_wise, table_wise
from recship.inference import assign_weights_to_tbe, get_table_to_weights_from_tbe
from recship.quantize.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from recship.sparse import KeyedJaggedTensor
from recship.trainer.planner.types import ShardingPlan


def _quantized():
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=6 + i, feature_names=[f"f{i}"]) for i in range(3)]
    ebc = EmbeddingBagCollection(tables=tables)
    ebc.qconfig = torch.quantization.QConfig(activation=torch.quantization.PlaceholderObserver.with_args(dtype=torch.float),
                                             weight=torch.quantization.PlaceholderObserver.with_args(dtype=torch.qint8))
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 3, (3 * 4,), generator=g)
    values = torch.cat([torch.randint(0, 6 + i, (int(lengths[4 * i:4 * i + 4].sum()),), generator=g) for i in range(3)])
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values, lengths=lengths)
    return QuantEmbeddingBagCollection.from_float(ebc), kjt, ebc


def test_table_wise_sharded_model_takes_the_quantized_weights_back():
    q, kjt, ebc = _quantized()
    expected = q(kjt).values()
    weights = get_table_to_weights_from_tbe(q)
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, {"t0": table_wise(rank=0), "t1": table_wise(rank=1),
                                                                "t2": table_wise(rank=1)}, world_size=2)})
    sharded = _shard_modules(q, env=ShardingEnv.from_local(2, 0), device="cpu", plan=plan)
    assert len(sharded.tbes) == 2  # one TBE per device
    for tbe in sharded.tbes:  # forget the rows, as TorchRec's sharding leaves them, then give them back
        for w, _ in tbe.split_embedding_weights():
            w.zero_()
    assert not torch.equal(sharded(kjt).values(), expected)
    assign_weights_to_tbe(sharded, weights)
    assert torch.equal(sharded(kjt).values(), expected)


def test_a_row_block_does_not_take_its_whole_table():
    q, _, ebc = _quantized()
    weights = get_table_to_weights_from_tbe(q)
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, {"t0": row_wise(), "t1": table_wise(rank=0), "t2": table_wise(rank=1)},
                                                           world_size=2)})
    sharded = _shard_modules(q, env=ShardingEnv.from_local(2, 0), device="cpu", plan=plan)
    with pytest.raises(ValueError, match="'t0@0' is a block of table 't0'"):
        assign_weights_to_tbe(sharded, weights)
