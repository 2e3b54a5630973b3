"""TorchRec's ``_shard_modules`` on quantized models, then recship.fx tracing and TorchScript.

The tutorial's inference steps (quantize_dynamic -> _shard_modules -> Tracer -> jit.script)
with its imports mapped to recship; every stage is compared with the unsharded quantized
module and with a plain-torch reference pooled from the dequantized rows.
"""

import io

import pytest
import torch
import torch.nn.functional as F
from torch import quantization as quant

from recship import QuantConfig
from recship.distributed import _shard_modules
from recship.quantize.sharded import ShardedQuantEmbeddingBagCollection
from recship.fx import Tracer
from recship.quantize import QuantEmbeddingBagCollection, dequantize_rows
from recship.quantize.embedding_modules import EmbeddingBagCollection as QuantEBC
from recship.quantize.rowwise import QuantizedRows
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from recship.trainer.distributed.types import ShardingEnv
from recship.trainer.planner.types import EmbeddingComputeKernel, ParameterSharding, ShardingPlan, ShardingType

from reference import InferenceModule, tables_kjt


TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=120, embedding_dim=64, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", num_embeddings=75, embedding_dim=32, feature_names=["f1", "f2"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t2", num_embeddings=33, embedding_dim=16, feature_names=["f3"]),
]


def _quantized(dtype=torch.int8, seed=0):
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(TABLES)
    with torch.no_grad():
        for t in TABLES:
            ebc.embedding_bags[t.name].weight.normal_(0, 0.1)
    qconfig = QuantConfig(activation=quant.PlaceholderObserver.with_args(dtype=torch.float),
                          weight=quant.PlaceholderObserver.with_args(dtype=dtype))
    return quant.quantize_dynamic(InferenceModule(ebc), qconfig_spec={EmbeddingBagCollection: qconfig},
                                  mapping={EmbeddingBagCollection: QuantEBC}, inplace=False)


def _reference(qebc, kjt):
    """Pooled lookups over the quantized module's dequantized rows, in plain torch."""
    per_feature = kjt.to_dict()
    out = []
    for t in TABLES:
        data, scale_bias = qebc.table_weights()[t.name]
        rows = dequantize_rows(QuantizedRows(data, scale_bias), qebc.weight_types()[t.name], t.embedding_dim)
        for f in t.feature_names:
            jt = per_feature[f]
            out.append(F.embedding_bag(jt.values(), rows, jt.offsets()[:-1], mode="mean" if t.pooling == PoolingType.MEAN else "sum"))
    return torch.cat(out, dim=1)


def test_the_tutorials_inference_steps_on_cpu():
    qmodel = _quantized()
    kjt = tables_kjt(TABLES, 7, seed=1)
    want = qmodel(kjt).values()
    torch.testing.assert_close(want, _reference(qmodel.ebc_, kjt), atol=1e-5, rtol=1e-5)

    sharded = _shard_modules(module=qmodel, device=torch.device("cpu"), env=ShardingEnv.from_local(1, 0))
    assert sharded is qmodel and type(sharded.ebc_) is ShardedQuantEmbeddingBagCollection  # in place, as TorchRec
    out = sharded(kjt)
    assert out.keys() == ["f0", "f1", "f2", "f3"] and out.length_per_key() == [64, 32, 32, 16]
    # MEAN tables are summed per shard and divided after merging: equal up to float rounding
    torch.testing.assert_close(out.values(), want, atol=1e-6, rtol=1e-6)
    want = out.values()

    graph = Tracer(leaf_modules=["IntNBitTableBatchedEmbeddingBagsCodegen"]).trace(sharded)
    gm = torch.fx.GraphModule(sharded, graph)
    assert [n.target for n in graph.nodes if n.op == "call_module"] == ["ebc_"]
    assert torch.equal(gm(kjt).values(), want)
    scripted = torch.jit.script(gm)
    assert torch.equal(scripted(kjt).values(), want)
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    kjt = tables_kjt(TABLES, 7, seed=9)
    assert torch.equal(torch.jit.load(buffer)(kjt).values(), sharded(kjt).values())


@pytest.mark.parametrize("dtype", [torch.quint4x2, torch.half])
def test_several_local_shards_answer_what_the_unsharded_module_does(dtype):
    qmodel = _quantized(dtype)
    kjt = tables_kjt(TABLES, 7, seed=1)
    want = qmodel(kjt).values()
    sharded = _shard_modules(qmodel, env=ShardingEnv.from_local(3, 1), device=torch.device("cpu"))
    assert len(sharded.ebc_.shards) == 3  # every table whole on one of the 3 devices
    assert sorted(n for s in sharded.ebc_.shards for n in s.embedding_bags) == ["t0@0", "t1@0", "t2@0"]
    torch.testing.assert_close(sharded(kjt).values(), want, atol=1e-6, rtol=1e-6)
    scripted = torch.jit.script(torch.fx.GraphModule(sharded, Tracer().trace(sharded)))
    torch.testing.assert_close(scripted(kjt).values(), want, atol=1e-6, rtol=1e-6)


def test_a_sharding_plan_places_tables_and_row_blocks():
    qmodel = _quantized()
    kjt = tables_kjt(TABLES, 7, seed=1)
    want = qmodel(kjt).values()
    kernel = EmbeddingComputeKernel.FUSED
    plan = ShardingPlan({"ebc_": {
        "t0": ParameterSharding(ShardingType.ROW_WISE, kernel, [0, 1]),
        "t1": ParameterSharding(ShardingType.TABLE_WISE, kernel, [1]),
        "t2": ParameterSharding(ShardingType.TABLE_WISE, kernel, [1]),
    }})
    sharded = _shard_modules(qmodel, env=ShardingEnv.from_local(2, 0), device=torch.device("cpu"), plan=plan)
    shards = sharded.ebc_.shards
    assert list(shards[0].embedding_bags) == ["t0@0"] and list(shards[1].embedding_bags) == ["t0@1", "t1@0", "t2@0"]
    assert shards[0].embedding_bags["t0@0"].weight.shape[0] == 60
    torch.testing.assert_close(sharded(kjt).values(), want, atol=1e-6, rtol=1e-6)
    # a collection the plan does not name stays unsharded, as in TorchRec
    other = _quantized()
    assert type(_shard_modules(other, env=ShardingEnv.from_local(2, 0), device="cpu", plan=ShardingPlan({})).ebc_) is QuantEmbeddingBagCollection


def test_a_bare_collection_and_resharding():
    qmodel = _quantized()
    kjt = tables_kjt(TABLES, 7, seed=1)
    whole = _shard_modules(qmodel.ebc_, env=ShardingEnv.from_local(1, 0), device="cpu")
    assert type(whole) is ShardedQuantEmbeddingBagCollection
    torch.testing.assert_close(whole(kjt).values(), qmodel(kjt).values(), atol=1e-6, rtol=1e-6)
    # an already sharded collection is left as it is (its per-device modules are not sharded again)
    model = InferenceModule(whole)
    assert _shard_modules(model, env=ShardingEnv.from_local(1, 0), device="cpu").ebc_ is whole


def test_bad_arguments_are_refused_by_name():
    env = ShardingEnv.from_local(2, 0)
    with pytest.raises(TypeError, match="is not a ModuleSharder"):
        _shard_modules(_quantized(), env=env, device="cpu", sharders=[object()])
    with pytest.raises(ValueError, match="init_process_group"):
        _shard_modules(_quantized(), device="cpu")
    kernel = EmbeddingComputeKernel.FUSED
    tw = ParameterSharding(ShardingType.TABLE_WISE, kernel, [0])
    with pytest.raises(ValueError, match="lacks its tables \\['t2'\\]"):
        _shard_modules(_quantized(), env=env, device="cpu", plan=ShardingPlan({"ebc_": {"t0": tw, "t1": tw}}))
    far = ParameterSharding(ShardingType.TABLE_WISE, kernel, [2])
    with pytest.raises(ValueError, match="table 't2' is placed on ranks \\[2\\], outside world_size 2"):
        _shard_modules(_quantized(), env=env, device="cpu", plan=ShardingPlan({"ebc_": {"t0": tw, "t1": tw, "t2": far}}))
    cw = ParameterSharding(ShardingType.COLUMN_WISE, kernel, [0, 1])
    with pytest.raises(ValueError, match="table 't0' is INT8: its rows cannot be split by columns"):
        _shard_modules(_quantized(), env=env, device="cpu", plan=ShardingPlan({"ebc_": {"t0": cw, "t1": tw, "t2": tw}}))
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        _shard_modules(_quantized(), env=env, device="meta")
