"""ShardedQuantEmbeddingBagCollection under TorchRec's constructor (module, table_name_to_parameter_sharding, env,
fused_params, device): table-, row- and column-wise blocks over 2 host-memory devices answer what a plain-torch pooling
of the quantized module's dequantized rows gives (FP16 column blocks, INT8 row blocks), with TorchRec's inference
fused_params choosing the blocks' state_dict layout."""

import pytest
import torch
import torch.nn.functional as F

from recship.quantize import QuantEmbeddingBagCollection, dequantize_rows
from recship.quantize.rowwise import QuantizedRows
from recship.quantize.sharded import ShardedQuantEmbeddingBagCollection
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagConfig, PoolingType
from recship.trainer.distributed.types import FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS, FUSED_PARAM_REGISTER_TBE_BOOL, ShardingEnv
from recship.trainer.planner.types import EmbeddingComputeKernel, ParameterSharding, ShardingType
from recship.modules.types import DataType

TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=40, embedding_dim=16, feature_names=["f0"], data_type=DataType.INT8),
    EmbeddingBagConfig(name="t1", num_embeddings=25, embedding_dim=8, feature_names=["f1", "f2"], pooling=PoolingType.MEAN,
                       data_type=DataType.FP16),
    EmbeddingBagConfig(name="t2", num_embeddings=30, embedding_dim=8, feature_names=["f3"], data_type=DataType.INT8),
]
PLAN = {
    "t0": ParameterSharding(ShardingType.ROW_WISE, EmbeddingComputeKernel.QUANT, [0, 1], None),
    "t1": ParameterSharding(ShardingType.COLUMN_WISE, EmbeddingComputeKernel.QUANT, [0, 1], None),
    "t2": ParameterSharding(ShardingType.TABLE_WISE, EmbeddingComputeKernel.QUANT, [1], None),
}


def _qebc() -> QuantEmbeddingBagCollection:
    torch.manual_seed(0)
    qebc = QuantEmbeddingBagCollection(TABLES, is_weighted=False, device=torch.device("cpu"))
    with torch.no_grad():
        for name, (data, scale_bias) in qebc.table_weights().items():  # random stored rows (and scales) to shard
            if qebc.weight_types()[name] == DataType.FP16:
                data.view(torch.float16).copy_(torch.randn(data.view(torch.float16).shape))
            else:
                data.copy_(torch.randint(0, 256, data.shape, dtype=torch.uint8))
            if scale_bias is not None:
                scale_bias.copy_(torch.rand(scale_bias.shape).to(scale_bias.dtype) * 0.01)
    return qebc


def _kjt() -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(1)
    rows = [40, 25, 25, 30]
    lengths = torch.randint(0, 4, (4, 5), generator=g)
    values = torch.cat([torch.randint(0, rows[i], (int(lengths[i].sum()),), generator=g) for i in range(4)])
    return KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=values, lengths=lengths.flatten().int())


def _reference(qebc: QuantEmbeddingBagCollection, kjt: KeyedJaggedTensor) -> torch.Tensor:
    per_feature = kjt.to_dict()
    out = []
    for t in TABLES:
        data, scale_bias = qebc.table_weights()[t.name]
        rows = dequantize_rows(QuantizedRows(data, scale_bias), qebc.weight_types()[t.name], t.embedding_dim)
        for f in t.feature_names:
            jt = per_feature[f]
            out.append(F.embedding_bag(jt.values(), rows, jt.offsets()[:-1], mode="mean" if t.pooling == PoolingType.MEAN else "sum"))
    return torch.cat(out, dim=1)


def test_torchrec_constructor_shards_as_the_plan_says():
    qebc, kjt = _qebc(), _kjt()
    sharded = ShardedQuantEmbeddingBagCollection(qebc, PLAN, ShardingEnv.from_local(2, 0), device=torch.device("cpu"))
    got = sharded(kjt)
    assert got.keys() == ["f0", "f1", "f2", "f3"]
    torch.testing.assert_close(got.values(), _reference(qebc, kjt), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.values(), qebc(kjt).values(), atol=1e-5, rtol=1e-5)
    blocks = {tbe_table for block in sharded.shards for tbe_table in block.table_weights()}
    assert blocks == {"t0@0", "t0@1", "t1@0", "t1@1", "t2@0"}  # two row blocks, two column blocks, one whole table
    assert [sorted(b.table_weights()) for b in sharded.shards] == [["t0@0", "t1@0"], ["t0@1", "t1@1", "t2@0"]]


def test_fused_params_layout_and_refusals():
    qebc = _qebc()
    split = ShardedQuantEmbeddingBagCollection(qebc, PLAN, ShardingEnv.from_local(2, 0),
                                               fused_params={FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS: True,
                                                             FUSED_PARAM_REGISTER_TBE_BOOL: True})
    plain = ShardedQuantEmbeddingBagCollection(qebc, PLAN, ShardingEnv.from_local(2, 0))
    assert any(k.endswith("weight_qscale") for k in split.state_dict()) and not any(k.endswith("weight_qscale") for k in plain.state_dict())
    with pytest.raises(ValueError, match="fused_params keys"):
        ShardedQuantEmbeddingBagCollection(qebc, PLAN, ShardingEnv.from_local(2, 0), fused_params={"learning_rate": 0.1})
    with pytest.raises(TypeError, match="QuantEmbeddingBagCollection"):
        ShardedQuantEmbeddingBagCollection(torch.nn.Linear(2, 2), PLAN, ShardingEnv.from_local(2, 0))
    with pytest.raises(ValueError, match="lacks its tables"):
        ShardedQuantEmbeddingBagCollection(qebc, {"t0": PLAN["t0"]}, ShardingEnv.from_local(2, 0))
    int8_columns = dict(PLAN, t0=ParameterSharding(ShardingType.COLUMN_WISE, EmbeddingComputeKernel.QUANT, [0, 1], None))
    with pytest.raises(ValueError, match="cannot be split by columns"):
        ShardedQuantEmbeddingBagCollection(qebc, int8_columns, ShardingEnv.from_local(2, 0))
