"""``torchrec.inference.modules`` as TorchRec users call it, through docs/torchrec.md's import map: the quantized model
answers what ``quantize_embeddings`` makes of the same model, and the sharded one what the unsharded quantized one
does (the same stored rows), with a ShardingPlan that describes the shards."""

import copy

import pytest
import torch

from recship.quantize import quantize_embeddings
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, ParameterConstraints
from tutorials.notebook import run_snippet

# TorchRec user code, kept out of .py files (torchrec is not a dependency: no .py file imports it)


def _model_and_kjt():
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t0", num_embeddings=40, embedding_dim=8, feature_names=["a"]),
                                  EmbeddingBagConfig(name="t1", num_embeddings=30, embedding_dim=8, feature_names=["b"])])
    model = torch.nn.Sequential()
    model.add_module("ebc", ebc)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 4, (2 * 6,), generator=g, dtype=torch.int32)
    values = (torch.rand(int(lengths.sum()), generator=g) * 30).long()
    return model, KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=lengths)


def test_quantize_then_shard_through_the_import_map():
    scope = run_snippet("torchrec_inference")
    quantize_inference_model, shard_quant_model = scope["quantize_inference_model"], scope["shard_quant_model"]
    model, kjt = _model_and_kjt()
    # TorchRec's rows: min/max per row (fbgemm's op), not recship's error-minimising INT4 clipping
    reference, _ = quantize_embeddings(copy.deepcopy(model), dtype="int4", table_dtypes={"t1": "fp16"}, error_minimizing=False)
    quantized = quantize_inference_model(model, per_table_weight_dtype={"t1": torch.float16}, quantization_dtype=torch.quint4x2)
    assert torch.equal(quantized.ebc(kjt).values(), reference.ebc(kjt).values())
    want = quantized.ebc(kjt).values()
    sharded, plan = shard_quant_model(quantized, world_size=2, compute_device="cpu",
                                      constraints={"t0": ParameterConstraints(sharding_types=["row_wise"])})
    torch.testing.assert_close(sharded.ebc(kjt).values(), want, atol=1e-6, rtol=0)  # row blocks sum in another order
    t0, t1 = plan.get_plan_for_module("ebc")["t0"], plan.get_plan_for_module("ebc")["t1"]
    assert t0.sharding_type == "row_wise" and [(s.shard_offsets, s.shard_sizes) for s in t0.shards] == [([0, 0], [20, 8]), ([20, 0], [20, 8])]
    assert t1.sharding_type == "table_wise" and [s.shard_sizes for s in t1.shards] == [[30, 8]]
    with pytest.raises(ValueError, match="output_dtype"):
        quantize_inference_model(_model_and_kjt()[0], output_dtype=torch.int8)
